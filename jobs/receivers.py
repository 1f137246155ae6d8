"""The jobs app's answers to what the fleet announces (fleet/signals.py)."""

from django.db.models import TextField
from django.db.models.functions import Cast
from django.dispatch import receiver

from fleet import signals
from fleet.models import Node
from jobs.models import ACTIVE_ATTEMPT_STATES, Attempt, AttemptState, FailureClass, Job


@receiver(signals.node_offline)
def lose_attempts(sender, node: Node, reason: str, **kwargs) -> None:
    """What ran on a node that went offline is lost (infra): its jobs are requeued."""
    live = Attempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES)
    # Any rank's node: a gang with one rank on a silent host cannot go on (its other ranks would wait).
    for attempt in [*live.filter(node=node), *other_rank_on(live, node)]:
        attempt.finish(AttemptState.LOST, FailureClass.INFRA, f"node {node.name} went offline: {reason}")


@receiver(signals.node_page)
def node_page_attempts(sender, node: Node, user, **kwargs) -> dict:
    return {"attempts": attempts_on(node, user)}


def attempts_on(node: Node, user, limit: int = 20) -> list:
    """The latest attempts of the user's projects that ran on this node: as rank 0 (`node`), or
    as another rank of a multi-node attempt (found in the placement's text, the same on SQLite
    and PostgreSQL: `"node_id": <pk>` then `,` or `}`; only multi-node jobs' placements are
    read, the rest have no other rank)."""
    visible = Attempt.objects.filter(job__in=Job.objects.visible_to(user)).select_related("job")
    as_rank_zero = visible.filter(node=node).order_by("-scheduled_at")[:limit]
    as_other_rank = other_rank_on(visible, node).order_by("-scheduled_at")[:limit]
    both = [*as_rank_zero, *as_other_rank]
    return sorted(both, key=lambda a: a.scheduled_at, reverse=True)[:limit]


def other_rank_on(attempts, node: Node):
    """Those of `attempts` with a rank other than rank 0 on `node`."""
    return (
        attempts.filter(job__nodes__gt=1)
        .exclude(node=node)
        .exclude(placement=[])
        .annotate(placement_text=Cast("placement", TextField()))
        .filter(placement_text__regex=rf'"node_id": {node.pk}[,}}]')
    )
