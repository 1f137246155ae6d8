"""Celery tasks of the scheduler. They take ids; the database row says what to do."""

from celery import shared_task

from jobs import scheduler


@shared_task(name="hangar.schedule")
def schedule(requested_at: float | None = None) -> int:
    """One scheduling pass (sent to the scheduler's queue on submit, finish and cancel),
    unless a pass that started after this wake-up was sent has completed already."""
    if scheduler.pass_already_covers(requested_at):
        return 0
    return len(scheduler.schedule_pass())
