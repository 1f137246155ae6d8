"""Celery tasks of the scheduler and the notifier. They take ids; the database row says what to do."""

from celery import shared_task

from jobs import notify, scheduler, tracking


@shared_task(name="hangar.schedule")
def schedule(requested_at: float | None = None, clock: str | None = None, queue_at=scheduler.QUEUE_CHANGED) -> int:
    """One scheduling pass (sent to the scheduler's queue on submit, finish and cancel),
    unless a pass that started after this wake-up was sent has completed already.
    `clock`: the sender's (portal/wakeup.py), to know whether its time reads ours;
    `queue_at`: when the latest request it answers that changed the queue was made (None:
    none did). A wake-up from an older sender does not say it: its request did."""
    if scheduler.pass_already_covers(requested_at, clock, queue_at):
        return 0
    return len(scheduler.schedule_pass())


@shared_task(name="hangar.notify_event")
def notify_event(kind: str, object_id: int) -> int:
    """An event (an attempt or job that ended, a node's cordon) becomes one delivery per subscriber."""
    return len(notify.fan_out(kind, object_id))


@shared_task(name="hangar.deliver")
def deliver(delivery_id: int) -> str:
    """One try of one delivery (webhook, Slack-compatible webhook or e-mail)."""
    return notify.deliver(delivery_id)


@shared_task(name="hangar.close_run")
def close_run(job_id: int) -> None:
    """What an older Hangar sent after an attempt's end (messages still queued at an upgrade;
    the notifier now settles each end itself, jobs/settling.py): its job's state and cost on its MLflow run."""
    tracking.attempt_finished(job_id)
