"""Celery tasks. They take ids; the database row says what to do."""

from celery import shared_task

from jobs import execution, scheduler


@shared_task(name="hangar.schedule")
def schedule() -> int:
    """One scheduling pass (sent to the scheduler's queue on submit, finish and cancel)."""
    return len(scheduler.schedule_pass())


@shared_task(name="hangar.run_attempt")
def run_attempt(attempt_id: int) -> None:
    """Sent to one node's queue: start that attempt there. Acknowledged early: a
    redelivered message finds the attempt already taken and does nothing."""
    execution.run_attempt(attempt_id)
