"""The scheduling pass: load the fleet and the queue, decide (jobs/policy.py, pure),
and apply the decision under row locks, dispatching after commit.

Two passes never hand out one GPU twice: a pass locks every schedulable node
row for its whole transaction (PostgreSQL: SELECT ... FOR NO KEY UPDATE; SQLite:
the IMMEDIATE transaction is the write lock), reads what live attempts hold only
after taking the lock, and a job leaves `queued` by a conditional update (the
queue itself is read before the lock).

NO KEY UPDATE, not UPDATE: it still excludes another pass, a cordon and a delete,
but not the KEY SHARE lock every insert's foreign-key check takes on the row it
references, so agents' log lines, health checks and events naming a node or a
job are not held up for the length of a pass (tests/test_sched_race.py).
"""

import functools
import logging
import os
import time
from collections import defaultdict
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Case, Exists, IntegerField, OuterRef, Subquery, Value, When
from django.utils import timezone

from fleet.models import CachedEnvironment, Node, heard_since_now
from jobs.metrics import SCHEDULER_PASS
from jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    STARTED_ATTEMPT_STATES,
    Attempt,
    AttemptState,
    Environment,
    FailureClass,
    Job,
    JobEvent,
    JobState,
    priority_class,
    priority_classes,
)
from jobs.policy import (  # noqa: F401  (place and friends are this module's public face too)
    FreeNode,
    Placement,
    Plan,
    ProjectLimits,
    QueuedJob,
    Request,
    RunningAttempt,
    UnreadyNode,
    estimate_starts,
    mark_borrowed,
    not_ready_detail,
    place,
    plan,
    refused_detail,
)
from portal import statements, wakeup
from portal.celery import app
from portal.models import Project

log = logging.getLogger("hangar.scheduler")

PASS_LIMIT = 20000  # queued jobs looked at in one pass
CHUNK = 500
WAKEUP_CLOCK_MARGIN = 0.5

NO_NODES: frozenset[int] = frozenset()
# Wall clock, of this process's completed passes: when the last one began (it read the queue
# after that), and when the last one began reading the fleet (under its locks).
last_pass_started = 0.0
last_pass_locked = 0.0
QUEUE_CHANGED = object()  # a wake-up that does not say: its commit may have changed the queue


# --- loading plain data -------------------------------------------------------


# The pass's own reads are statements compiled once (portal/statements.py): building and
# compiling their SQL anew took about a quarter of a pass's CPU (bench/throughput.py).


@statements.query
def schedulable_nodes_locked(heard_since: datetime):
    """Locked in id order, by every pass alike."""
    return Node.objects.schedulable(heard_since).select_for_update(no_key=True).order_by("pk")


@statements.query
def environments_everywhere():
    return Environment.objects.filter(everywhere=True).values_list("name", flat=True)


@statements.query
def live_attempts():
    return (
        Attempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES)
        .order_by("scheduled_at", "pk")
        .values(
            "pk", "job_id", "node_id", "gpu_indices", "placement", "borrowed", "scheduled_at", "running_at",
            "preempt_requested_at", "cancel_requested_at", "job__project_id", "job__submitted_by_id",
            "job__priority", "job__preemptible", "job__max_runtime_seconds",
        )
    )  # fmt: skip


@statements.query
def project_limit_rows():
    return Project.objects.values_list(
        "pk", "gpu_quota", "may_borrow", "max_running_jobs", "max_running_jobs_per_user", "max_gpus_per_job"
    )


@statements.query
def advertised_environments(heard_since: datetime):
    """(node id, environment name) for what the schedulable nodes advertise."""
    on = Node.objects.schedulable(heard_since)
    return Environment.nodes.through.objects.filter(node__in=on).values_list("node_id", "environment__name")


@statements.query
def held_caches(heard_since: datetime):
    """(node id, requirement keys) of the cached environments the schedulable nodes hold."""
    on = Node.objects.schedulable(heard_since)
    # No ordering: its default goes through the nodes.
    return CachedEnvironment.objects.filter(node__in=on).order_by().values_list("node_id", "keys")


def node_environments(nodes: list[Node], heard_since: datetime) -> dict[int, frozenset[str]]:
    """The environments each node can run jobs in. `heard_since`: the one `nodes` were read
    with (this and node_caches read by it, not by a list of ids, whose number would change
    their SQL); a node that became schedulable since is not in `nodes`, its rows are left out."""
    everywhere = set(environments_everywhere.rows())
    advertised: dict[int, set[str]] = defaultdict(set)
    for node_id, name in advertised_environments.rows(heard_since=heard_since):
        advertised[node_id].add(name)
    return {n.pk: frozenset(everywhere | advertised[n.pk]) for n in nodes}


def node_caches(nodes: list[Node], heard_since: datetime) -> dict[int, frozenset[str]]:
    """The requirement keys of the cached environments each node holds (agent/envcache.py reports them)."""
    keys: dict[int, set[str]] = defaultdict(set)
    for node_id, held in held_caches.rows(heard_since=heard_since):
        keys[node_id].update(held or [])
    return {n.pk: frozenset(keys[n.pk]) for n in nodes}


def nodes_offer(
    jobs: list[QueuedJob], nodes: list[Node], heard_since: datetime
) -> tuple[dict[int, frozenset[str]], dict[int, frozenset[str]]]:
    """The environments and cached environments of the nodes, each read only when a job of the
    pass asks for one: a plan looks at a node's environments for a job that names one, and at
    its caches for one with requirements (warm-cache affinity). Most queues ask for neither, and
    a pass then sends three statements fewer (of twelve placing one job)."""
    envs = node_environments(nodes, heard_since) if any(j.request.environment for j in jobs) else {}
    caches = node_caches(nodes, heard_since) if any(j.request.env_key for j in jobs) else {}
    return envs, caches


def free_gpus(
    nodes: list[Node],
    running: list[RunningAttempt],
    envs: dict[int, frozenset[str]],
    caches: dict[int, frozenset[str]] | None = None,
) -> list[FreeNode]:
    """What the nodes have free: every GPU no live attempt's rank holds. A fresh list
    each call: a plan takes GPUs out of the lists it is given."""
    used: dict[int, set[int]] = defaultdict(set)
    for attempt in running:
        for node_id, gpus in attempt.placement:
            used[node_id].update(gpus)
    caches = caches or {}
    return [
        FreeNode(
            n.pk,
            n.gpu_model,
            [i for i in range(n.gpu_count) if i not in used[n.pk]],
            envs.get(n.pk, frozenset()),
            n.gpu_count,
            caches.get(n.pk, frozenset()),
        )
        for n in nodes
    ]


def running_attempts(now=None) -> list[RunningAttempt]:
    now = now or timezone.now()
    out, classes = [], priority_classes()
    for r in live_attempts.rows():
        started = r["running_at"] or r["scheduled_at"]
        elapsed = max(0.0, (now - started).total_seconds())
        cls = classes.get(r["job__priority"]) or priority_class(r["job__priority"])
        out.append(
            RunningAttempt(
                attempt_id=r["pk"],
                job_id=r["job_id"],
                placement=[(p["node_id"], p["gpus"]) for p in r["placement"]] or [(r["node_id"], r["gpu_indices"])],
                project_id=r["job__project_id"],
                user_id=r["job__submitted_by_id"],
                rank=cls.rank,
                preemptible=bool(r["job__preemptible"]) or cls.preemptible,
                borrowed=r["borrowed"],
                elapsed=elapsed,
                remaining=max(0.0, r["job__max_runtime_seconds"] - elapsed),
                preempting=r["preempt_requested_at"] is not None or r["cancel_requested_at"] is not None,
            )
        )
    return out


def queue_order(ranks: tuple[tuple[str, int], ...]):
    """Queued jobs in the order they are considered: class rank, then place in the queue.
    `ranks`: (class name, rank) pairs of the configured classes (class_ranks())."""
    rank = Case(
        *(When(priority=name, then=Value(r)) for name, r in ranks), default=Value(-1), output_field=IntegerField()
    )
    return Job.objects.filter(state=JobState.QUEUED).annotate(rank=rank).order_by("-rank", "order_at", "id")


def class_ranks() -> tuple[tuple[str, int], ...]:
    return tuple((name, cls.rank) for name, cls in priority_classes().items())


@functools.lru_cache(maxsize=8)
def the_queue(ranks: tuple[tuple[str, int], ...], placeable: bool = False) -> statements.Statement:
    """The queue's read as a statement, one per set of classes (their ranks are in its SQL).
    `placeable`: a pass's read, which has no rows while no node is schedulable (heard from since
    its `heard_since`): one statement for both questions, a round trip less in every pass
    (bench/start_latency.py's placed stage). PostgreSQL answers the node half once, as a one-time
    filter of its plan, and reads no queue when it is no (a cordoned fleet's, however long)."""

    def queue():
        return queue_order(ranks).values_list(*QUEUE_FIELDS)[:PASS_LIMIT]

    def placeable_queue(heard_since: datetime):
        somewhere = Exists(Node.objects.schedulable(heard_since))
        return queue_order(ranks).filter(somewhere).values_list(*QUEUE_FIELDS)[:PASS_LIMIT]

    return statements.query(placeable_queue if placeable else queue)


QUEUE_FIELDS = (
    "pk", "project_id", "submitted_by_id", "priority", "gpus_per_node", "gpu_type", "nodes",
    "environment__name", "requirements_key", "max_runtime_seconds", "retries", "requeues", "preemptions",
)  # fmt: skip


def queued_jobs(placeable_since: datetime | None = None) -> list[QueuedJob]:
    """The queue as the policy reads it (its first PASS_LIMIT jobs). Every pass reads all of it
    (a long queue on a busy fleet: most of a pass), so as tuples, with one Request per shape:
    most jobs share a few. `placeable_since`: none while no node heard from since then is
    schedulable (the_queue's `placeable`)."""
    if placeable_since is None:
        rows = the_queue(class_ranks()).rows()
    else:
        rows = the_queue(class_ranks(), placeable=True).rows(heard_since=placeable_since)
    classes, shapes = priority_classes(), {}
    avoid = suspected_nodes([row[0] for row in rows if ran_before(*row[-3:])])
    out = []
    for pk, project_id, user_id, priority, gpus, gpu_type, nodes, env, key, runtime, *_ in rows:
        cls = classes.get(priority) or priority_class(priority)
        shape = (gpus, gpu_type, nodes, env or "", key)
        if (request := shapes.get(shape)) is None:
            request = shapes[shape] = Request(*shape)
        out.append(
            QueuedJob(
                pk, request, project_id, user_id, cls.rank, cls.may_preempt, float(runtime), avoid.get(pk, NO_NODES)
            )
        )
    return out


def ran_before(retries: int, requeues: int, preemptions: int) -> bool:
    """Whether a queued job had an attempt: the only way back to the queue after one is a requeue
    (Attempt._move_job_on), which counts a retry, a requeue or a preemption. A job fresh from
    its submit (most of a queue) has no suspicion to read."""
    return bool(retries or requeues or preemptions)


def suspected_nodes(job_ids: list[int]) -> dict[int, frozenset[int]]:
    """Nodes each job avoids: where its own output reported a fault that did not cordon the node
    (a suspicion). A job whose output names a fault must not walk the fleet node after node."""
    from fleet.models import HealthEvent

    if not job_ids:
        return {}
    rows = HealthEvent.objects.filter(attempt__job_id__in=job_ids, source="output").values_list(
        "attempt__job_id", "node_id"
    )
    out: dict[int, set[int]] = {}
    for job_id, node_id in rows:
        out.setdefault(job_id, set()).add(node_id)
    return {job_id: frozenset(nodes) for job_id, nodes in out.items()}


def project_limits() -> dict[int, ProjectLimits]:
    return {pk: ProjectLimits(*fields) for pk, *fields in project_limit_rows.rows()}


# --- the pass -------------------------------------------------------------------


def schedule_pass() -> list[Attempt]:
    """Place what fits now and preempt what must make room. Safe to run concurrently."""
    global last_pass_started, last_pass_locked
    started = time.time()
    with SCHEDULER_PASS.time():
        placed, locked = _schedule_pass()
    last_pass_started = max(last_pass_started, started)  # only a pass that completed
    last_pass_locked = max(last_pass_locked, locked)
    return placed


def pass_already_covers(requested_at: float | None, clock: str | None = None, queue_at=QUEUE_CHANGED) -> bool:
    """A wake-up sent (after its commit) before a completed pass of this process started
    needs no pass of its own: that pass read the queue after the commit. A sender on this
    machine (`clock`: its boot id is ours) read the same clock; for one on another machine
    the margin allows for the two clocks to differ.

    `requested_at` is the latest request the wake-up answers, `queue_at` the latest of them
    whose commit changed the queue (None: none did; not said: the latest did). A request that
    changed only the fleet (GPUs freed, a node's state) is answered by a pass that began
    reading the fleet under its locks after it: the nodes, what live attempts hold and the
    nodes' environments are read there, each statement after the commit.

    Under load that is many wake-ups: every finish sends one, and one that queued up behind a
    pass would run another that finds its GPUs handed out already (bench/throughput.py, 600
    jobs: 330 passes, 73 placing nothing, with the margin for every sender and the wake-up
    timed at its send; 262 and 17 with neither)."""
    if requested_at is None:
        return False
    if queue_at is QUEUE_CHANGED:
        queue_at = requested_at
    margin = 0.0 if clock is not None and clock == wakeup.CLOCK else WAKEUP_CLOCK_MARGIN
    if queue_at is not None and queue_at >= last_pass_started - margin:
        return False
    return requested_at < last_pass_locked - margin


def _schedule_pass() -> tuple[list[Attempt], float]:
    """The attempts placed, and when the pass began reading the fleet under its locks (or,
    finding no node to place on or no job to place, began looking)."""
    looked = time.time()
    heard_since = heard_since_now()
    # The queue and the quotas are read before the locks: a job leaves `queued` only by the
    # conditional update under them (_start_chunk), so one placed by another pass or cancelled
    # meanwhile is skipped there, and a preemption is asked only for a job still queued. What
    # live attempts hold is read under them. (On SQLite the pass's transaction holds the one
    # write turn: reading a long queue in it kept every agent's write waiting.)
    jobs = queued_jobs(placeable_since=heard_since)  # none on a cordoned fleet: its queue is not read
    if not jobs:  # nothing to place or make room for: the fleet need not be read (an idle fleet's finishes)
        return [], looked
    projects = project_limits()
    with transaction.atomic():
        locked = time.time()  # before the first read of the fleet: it sees every commit before this
        nodes = schedulable_nodes_locked.rows(heard_since=heard_since)
        if not nodes:
            return [], locked
        running = running_attempts()
        mark_borrowed(running, projects)  # by the quotas as they are now
        envs, caches = nodes_offer(jobs, nodes, heard_since)
        free = free_gpus(nodes, running, envs, caches)
        decided = plan(jobs, free, running, projects)
        placed = start_attempts(decided.placements, {n.pk: n for n in nodes})
        waiting = still_queued(set(decided.preemptions.values()))
        for attempt_id, job_id in decided.preemptions.items():
            if job_id in waiting:
                preempt(attempt_id, f"preempted to make room for job {job_id}")
    return placed, locked


def still_queued(job_ids: set[int]) -> set[int]:
    """Of these jobs, those still queued, read under the pass's locks."""
    if not job_ids:
        return set()
    return set(Job.objects.filter(pk__in=job_ids, state=JobState.QUEUED).values_list("pk", flat=True))


def start_attempts(placements: list[Placement], nodes: dict[int, Node]) -> list[Attempt]:
    placed = []
    for start in range(0, len(placements), CHUNK):
        placed += _start_chunk(placements[start : start + CHUNK], nodes)
    return placed


@statements.query
def still_queued_locked(ids: list[int]):
    """Of these jobs, those still queued, locked, each with the number of its latest attempt."""
    latest = Attempt.objects.filter(job_id=OuterRef("pk")).order_by("-number").values("number")[:1]
    queued = Job.objects.select_for_update(no_key=True).filter(pk__any=ids, state=JobState.QUEUED)
    return queued.annotate(latest=Subquery(latest)).values_list("pk", "queued_at", "latest")


@statements.update
def jobs_scheduled(ids: list[int]):
    """Queued jobs placed: only one still queued moves on (one cancelled meanwhile is left alone)."""
    return Job.objects.filter(pk__any=ids, state=JobState.QUEUED), {"state": JobState.SCHEDULED}


def _start_chunk(placements: list[Placement], nodes: dict[int, Node]) -> list[Attempt]:
    jobs, numbers = {}, {}
    for pk, queued_at, number in still_queued_locked.rows(ids=[p.job_id for p in placements]):
        jobs[pk], numbers[pk] = queued_at, number
    jobs_scheduled.update(ids=list(jobs))
    now = timezone.now()
    attempts = [
        Attempt(
            job_id=p.job_id,
            number=(numbers.get(p.job_id) or 0) + 1,
            node=nodes[p.ranks[0][0]],
            gpu_indices=p.ranks[0][1],
            placement=[
                {"rank": r, "node_id": n, "node": nodes[n].name, "gpus": gpus} for r, (n, gpus) in enumerate(p.ranks)
            ],
            borrowed=p.borrowed,
            queued_at=jobs[p.job_id],
            scheduled_at=now,
        )
        for p in placements
        if p.job_id in jobs
    ]
    Attempt.objects.bulk_create(attempts)
    warm = {p.job_id: [nodes[n].name for n in p.warm] for p in placements}
    events = [(a.job_id, a.pk, now, "scheduled", describe_placement(a, warm.get(a.job_id))) for a in attempts]
    JobEvent.insert_rows(events)
    for a in attempts:
        for rank in a.placement:
            queue = nodes[rank["node_id"]].queue
            # robust: one failed send must not skip the others; the reconciler requeues what was not sent.
            transaction.on_commit(lambda a=a.pk, q=queue, r=rank["rank"]: dispatch(a, q, r), robust=True)
    return attempts


def describe_placement(attempt: Attempt, warm: list[str] | None = None) -> str:
    where = "; ".join(f"rank {r['rank']} on {r['node']} GPUs {r['gpus']}" for r in attempt.placement)
    if warm:  # the scheduler's warm-cache affinity chose them among otherwise equal nodes
        where += f" (its environment is cached on {', '.join(warm)})"
    return where + (" (borrowed beyond the project's quota)" if attempt.borrowed else "")


def preempt(attempt_id: int, reason: str) -> bool:
    """Stop an attempt to make room: one not yet started ends now; a started one is
    asked to stop (its agent sends SIGTERM, waits the grace period, then SIGKILL)."""
    attempt = Attempt.objects.filter(pk=attempt_id).first()
    if attempt is None:
        return False
    if attempt.finish(AttemptState.PREEMPTED, FailureClass.PREEMPTED, reason, from_states=[AttemptState.SCHEDULED]):
        return True
    asked = Attempt.objects.filter(
        pk=attempt_id, state__in=STARTED_ATTEMPT_STATES, preempt_requested_at=None, cancel_requested_at=None
    ).update(preempt_requested_at=timezone.now(), reason=reason)
    if asked:
        JobEvent.objects.create(job_id=attempt.job_id, attempt=attempt, kind="preempt", message=reason)
    return bool(asked)


def dispatch(attempt_id: int, queue: str, rank: int = 0) -> None:
    """Wake the node's agent to start that rank (agent/tasks.py, sent by name)."""
    if settings.HANGAR_FAULT_SCHEDULER_DIE_BEFORE_PUBLISH:
        # Drill-only fault: the placement is committed, its wake-up never sent.
        log.error("fault injected: the scheduler dies before publishing attempt %s", attempt_id)
        os._exit(137)
    app.send_task("hangar.run_attempt", args=[attempt_id, rank], queue=queue)


def reconcile() -> None:
    """Mark silent nodes offline, end attempts whose lease expired or that never started,
    flag hung jobs, settle ended attempts whose settling never came."""
    Node.mark_silent_offline()
    for attempt in Attempt.expire_leases() + Attempt.expire_unstarted():
        log.warning("attempt %s of job %s ended as lost: %s", attempt.number, attempt.job_id, attempt.reason)
    from jobs.diagnosing import check_hangs
    from jobs.settling import settle_overdue

    check_hangs()
    settle_overdue()


# --- the queue as users see it ----------------------------------------------------


def unready_nodes(schedulable: set[int]) -> list[UnreadyNode]:
    rows = Node.objects.exclude(pk__in=schedulable).order_by("name")
    rows = rows.values_list("name", "gpu_model", "gpu_count", "state", "state_reason")
    # A ready node that is not schedulable has gone silent: it is offline in all but name.
    return [UnreadyNode(n, m, c, "silent" if s == "ready" else s, r) for n, m, c, s, r in rows]


def refused_environments() -> dict[str, list[str]]:
    """Environment name -> "node: why" for the nodes that would not offer it (agent/sandbox.py)."""
    out: dict[str, list[str]] = {}
    for name, refused in Node.objects.exclude(refused_environments={}).values_list("name", "refused_environments"):
        for environment, why in refused.items():
            out.setdefault(environment, []).append(f"{name}: {why}")
    return out


def queue_report(now=None) -> tuple[list[dict], dict[int, dict]]:
    """Every queued job in order with why it waits and when it should start, read
    without locks (a dry run of the next pass); and the reasons by job id."""
    now = now or timezone.now()
    heard_since = heard_since_now()
    nodes = list(Node.objects.schedulable(heard_since).order_by("pk"))
    running, projects = running_attempts(now), project_limits()
    mark_borrowed(running, projects)
    jobs = queued_jobs()
    envs, caches = nodes_offer(jobs, nodes, heard_since)
    unready = unready_nodes({n.pk for n in nodes})
    decided = plan(jobs, free_gpus(nodes, running, envs, caches), running, projects)
    starts = estimate_starts(jobs, free_gpus(nodes, running, envs, caches), running)
    starting = {p.job_id for p in decided.placements}
    rows, refusals = [], None
    for position, job in enumerate(jobs, start=1):
        waiting = decided.waiting.get(job.job_id)
        if job.job_id in starting:
            reason = {"code": "starting", "message": "fits now: starts at the next scheduling pass"}
        elif waiting is not None:
            waiting = not_ready_detail(job.request, waiting, unready)
            if waiting.code == "environment":
                refusals = refused_environments() if refusals is None else refusals
                waiting = refused_detail(job.request, waiting, refusals)
            reason = {"code": waiting.code, "message": waiting.message}
        else:
            reason = {"code": "capacity", "message": "waiting for free GPUs"}
        seconds = 0.0 if job.job_id in starting else starts.get(job.job_id)
        estimate = None if seconds is None else now + timedelta(seconds=seconds)
        rows.append({"job_id": job.job_id, "position": position, "reason": reason, "estimated_start": estimate})
    return rows, {r["job_id"]: r for r in rows}
