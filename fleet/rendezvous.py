"""Who is to blame when a multi-node job's ranks cannot meet, and what is done about it.

Every rank other than rank 0 connects to rank 0's advertised address before the command
starts (agent/preflight.py). When one cannot, the evidence points at a node:

- a problem with the rank's own host (its interface has no address, its name resolves to
  no routable address, so gloo and NCCL would fall back to loopback): the rank's node;
- rank 0's address does not resolve where the rank is: rank 0's node (what it advertises);
- rank 0 unreachable: rank 0's node if no other rank reached it, the reporting rank's node
  if another rank did (this one reaches nobody).

That node becomes a suspect (a health event, source `preflight`), not a cordon: the
attempt fails as infra and the job is requeued. It is cordoned once
HANGAR_RENDEZVOUS_SUSPICIONS attempts within the corroboration window point at it.
"""

from dataclasses import dataclass

from django.conf import settings

from fleet import health
from fleet.corroboration import counted_since
from fleet.models import HealthCheck, HealthEvent, Node

OWN_HOST = "own_host"
RANK_ZERO_UNRESOLVED = "rank_zero_unresolved"
UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Failure:
    kind: str  # OWN_HOST, RANK_ZERO_UNRESOLVED or UNREACHABLE
    evidence: str


def suspect_is_rank_zero(failure: Failure, others_reached_rank_zero: bool) -> bool:
    """Whether the evidence points at rank 0's node (else at the reporting rank's own)."""
    if failure.kind == OWN_HOST:
        return False
    if failure.kind == RANK_ZERO_UNRESOLVED:
        return True
    return not others_reached_rank_zero


def others_reached(attempt, rank_zero_node_id: int, own_node_id: int) -> bool:
    """Another rank's rendezvous check of this attempt passed (rank 0's own listening aside)."""
    return (
        HealthCheck.objects.filter(attempt_id=attempt.pk, name="rendezvous", passed=True)
        .exclude(node_id__in=[rank_zero_node_id, own_node_id])
        .exists()
    )


def blame(attempt, rank: int, own: Node, rank_zero: Node, failure: Failure) -> tuple[Node, bool]:
    """Record the suspicion the failure points at; returns (the suspect node, whether it was cordoned)."""
    at_zero = suspect_is_rank_zero(failure, others_reached(attempt, rank_zero.pk, own.pk))
    suspect = rank_zero if at_zero else own
    why = (
        f"rank {rank} on {own.name} could not reach rank 0 on {rank_zero.name}"
        if failure.kind != OWN_HOST
        else f"rank {rank} on {own.name}: its own host's network"
    )
    evidence = {
        "attempt": attempt.pk,
        "rank": rank,
        "reported_by": own.name,
        "rank_zero_node": rank_zero.name,
        "failure": failure.kind,
        "check": failure.evidence,
        "points_at": "rank 0's node" if at_zero else "the reporting rank's node",
    }
    event = HealthEvent.objects.create(
        node=suspect,
        attempt_id=attempt.pk,
        kind=health.Kind.RENDEZVOUS,
        severity="warning",
        source=health.Source.PREFLIGHT,
        message=f"rendezvous failed: {why}: {failure.evidence}",
        evidence=evidence,
        action="suspected",
    )
    suspicions = list(
        HealthEvent.objects.filter(node=suspect, kind=health.Kind.RENDEZVOUS, at__gte=counted_since(suspect))
        .exclude(attempt_id=None)
        .order_by("at")
        .values("pk", "attempt_id", "message")
    )
    attempts = {s["attempt_id"] for s in suspicions}
    if len(attempts) < settings.HANGAR_RENDEZVOUS_SUSPICIONS:
        return suspect, False
    cordoned = suspect.auto_cordon(
        f"rendezvous failed for {len(attempts)} attempts pointing at this node: {failure.evidence}",
        {
            "source": health.Source.PREFLIGHT,
            "related_events": [
                {"health_event": s["pk"], "attempt": s["attempt_id"], "message": s["message"]} for s in suspicions
            ],
        },
    )
    HealthEvent.objects.filter(pk=event.pk).update(action="cordoned" if cordoned else "suspected (already cordoned)")
    return suspect, cordoned
