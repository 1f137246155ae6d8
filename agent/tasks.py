"""The Celery tasks a node's agent consumes from its node's queue. They take ids; the
database row says what to do. Senders name them (`hangar.run_attempt`, ...) and never
import this module, so no other process loads the agent's runtime."""

from celery import shared_task

from agent import runner, stress


@shared_task(name="hangar.run_attempt")
def run_attempt(attempt_id: int, rank: int = 0) -> None:
    """Start that rank of the attempt on this node. Acknowledged early: a redelivered
    message finds the rank already taken and does nothing."""
    runner.run_attempt(attempt_id, rank)


@shared_task(name="hangar.burn_in_stress")
def burn_in_stress(node_id: int) -> None:
    """Run the burn-in's stress step on this node and record it."""
    stress.stress_here(node_id)
