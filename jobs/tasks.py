"""Celery tasks. They take ids; the database row says what to do."""

from celery import shared_task

from jobs import execution, scheduler


@shared_task(name="hangar.schedule")
def schedule(requested_at: float | None = None) -> int:
    """One scheduling pass (sent to the scheduler's queue on submit, finish and cancel),
    unless a pass that started after this wake-up was sent has completed already."""
    if scheduler.pass_already_covers(requested_at):
        return 0
    return len(scheduler.schedule_pass())


@shared_task(name="hangar.run_attempt")
def run_attempt(attempt_id: int, rank: int = 0) -> None:
    """Sent to one node's queue: start that rank of the attempt there. Acknowledged early:
    a redelivered message finds the rank already taken and does nothing."""
    execution.run_attempt(attempt_id, rank)
