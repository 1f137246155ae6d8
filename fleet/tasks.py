"""Celery tasks of the fleet. They take ids; the database row says what to do."""

from celery import shared_task


@shared_task(name="hangar.burn_in_stress")
def burn_in_stress(node_id: int) -> None:
    """Sent to one node's queue: its agent runs the burn-in's stress step and records it."""
    from fleet.preflight import stress_here

    stress_here(node_id)
