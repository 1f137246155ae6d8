"""Placing queued jobs on nodes with free GPUs.

`place` is the pure decision (plain data in, plain data out); `schedule_pass`
loads the fleet, applies it under row locks and dispatches after commit.
"""

import logging
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Case, IntegerField, Value, When
from django.utils import timezone

from fleet.models import Node
from jobs.models import ACTIVE_ATTEMPT_STATES, Attempt, Job, JobEvent, JobState, Priority

log = logging.getLogger("hangar.scheduler")

PASS_LIMIT = 1000  # queued jobs looked at in one pass


@dataclass
class FreeNode:
    node_id: int
    gpu_model: str
    free: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Request:
    gpus: int
    gpu_type: str = ""


def place(request: Request, nodes: list[FreeNode]) -> tuple[int, list[int]] | None:
    """The node and GPU indices for a one-node request, or None if nothing fits.

    Best fit: the node with the fewest free GPUs that still fits, so a small
    job fills a partly used node rather than breaking into an empty one.
    """
    fits = [
        n for n in nodes if len(n.free) >= request.gpus and (not request.gpu_type or n.gpu_model == request.gpu_type)
    ]
    if not fits:
        return None
    best = min(fits, key=lambda n: (len(n.free), n.node_id))
    return best.node_id, sorted(best.free)[: request.gpus]


def free_gpus(nodes: list[Node]) -> list[FreeNode]:
    used: dict[int, set[int]] = {}
    live = Attempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES, node__in=nodes).values_list("node_id", "gpu_indices")
    for node_id, indices in live:
        used.setdefault(node_id, set()).update(indices)
    return [
        FreeNode(n.pk, n.gpu_model, [i for i in range(n.gpu_count) if i not in used.get(n.pk, set())]) for n in nodes
    ]


def queued_jobs():
    rank = Case(*(When(priority=p.value, then=Value(p.rank)) for p in Priority), output_field=IntegerField())
    return Job.objects.filter(state=JobState.QUEUED).annotate(rank=rank).order_by("-rank", "queued_at", "id")


def schedule_pass() -> list[Attempt]:
    """Place what fits now. Safe to run concurrently: node rows are locked for the pass."""
    with transaction.atomic():
        nodes = list(Node.objects.schedulable().select_for_update().order_by("pk"))
        if not nodes:
            return []
        fleet = free_gpus(nodes)
        by_id = {n.pk: n for n in nodes}
        free_by_id = {f.node_id: f for f in fleet}
        placed = []
        for job in queued_jobs()[:PASS_LIMIT]:
            spot = place(Request(job.gpus_per_node, job.gpu_type), fleet)
            if spot is None:
                continue
            node_id, indices = spot
            attempt = start_attempt(job, by_id[node_id], indices)
            if attempt is not None:
                free_by_id[node_id].free = [i for i in free_by_id[node_id].free if i not in indices]
                placed.append(attempt)
    return placed


def start_attempt(job: Job, node: Node, gpu_indices: list[int]) -> Attempt | None:
    if not Job.objects.filter(pk=job.pk, state=JobState.QUEUED).update(state=JobState.SCHEDULED):
        return None
    number = job.attempts.count() + 1
    attempt = Attempt.objects.create(
        job=job,
        number=number,
        node=node,
        gpu_indices=gpu_indices,
        queued_at=job.queued_at,
        scheduled_at=timezone.now(),
    )
    JobEvent.objects.create(job=job, attempt=attempt, kind="scheduled", message=f"on {node.name} GPUs {gpu_indices}")
    transaction.on_commit(lambda: dispatch(attempt.pk, node.queue))
    return attempt


def dispatch(attempt_id: int, queue: str) -> None:
    from jobs.tasks import run_attempt

    run_attempt.apply_async(args=[attempt_id], queue=queue)


def reconcile() -> None:
    """Mark silent nodes offline, end attempts whose lease expired or that never started."""
    Node.mark_silent_offline()
    for attempt in Attempt.expire_leases() + Attempt.expire_unstarted():
        log.warning("attempt %s of job %s ended as lost: %s", attempt.number, attempt.job_id, attempt.reason)


def request_pass() -> None:
    """Ask the scheduler for a pass as soon as the current transaction commits."""
    from jobs.tasks import schedule

    transaction.on_commit(lambda: schedule.apply_async(queue="hangar.scheduler"))
