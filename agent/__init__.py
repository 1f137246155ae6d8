"""What runs on a GPU node: the agent process (a Celery worker on its node's queue),
its heartbeat and telemetry, the runner that starts a job's ranks, their environments,
the output reader and spooler, the live preflight and stress, and output watching.
Only the agent process imports this app; nothing below it does."""
