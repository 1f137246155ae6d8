"""The scheduling policy as pure functions over plain data: no database here.

`plan` decides one pass: which queued jobs start where (gang, all or nothing,
packed best-fit), which running attempts are preempted for whom, and why every
other job waits. `estimate_starts` says when waiting jobs should start.
`jobs/scheduler.py` loads the fleet and the queue, calls these, and applies
the result under row locks.
"""

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

MAX_RESERVATIONS = 8  # blocked jobs whose estimated start backfill must not delay


@dataclass
class FreeNode:
    node_id: int
    gpu_model: str
    free: list[int] = field(default_factory=list)
    environments: frozenset[str] = frozenset()
    gpu_count: int = 0
    cached: frozenset[str] = frozenset()  # requirement keys of the cached environments it holds

    def __post_init__(self):
        self.gpu_count = self.gpu_count or len(self.free)


@dataclass(frozen=True)
class Request:
    gpus: int  # per node
    gpu_type: str = ""
    nodes: int = 1
    environment: str = ""
    env_key: str = ""  # its cached environment's requirement key: nodes holding it are preferred

    def matches(self, node: FreeNode) -> bool:
        return (not self.gpu_type or node.gpu_model == self.gpu_type) and (
            not self.environment or self.environment in node.environments
        )

    @property
    def total(self) -> int:
        return self.gpus * self.nodes


@dataclass
class QueuedJob:
    job_id: int
    request: Request
    project_id: int = 0
    user_id: int = 0
    rank: int = 0
    may_preempt: bool = False
    runtime: float = 3600.0  # its max runtime: what an estimate may assume
    avoid: frozenset[int] = frozenset()  # nodes where its own output reported a fault not (yet) corroborated


@dataclass
class RunningAttempt:
    attempt_id: int
    job_id: int
    placement: list[tuple[int, list[int]]]  # (node id, GPU indices) by rank
    project_id: int = 0
    user_id: int = 0
    rank: int = 0
    preemptible: bool = False
    borrowed: bool = False
    elapsed: float = 0.0  # seconds run: what preempting it loses
    remaining: float = 3600.0  # seconds until its max runtime ends it
    preempting: bool = False

    @property
    def gpus(self) -> int:
        return sum(len(g) for _, g in self.placement)

    @property
    def cost(self) -> float:
        """GPU-hours lost if it is stopped now."""
        return self.gpus * self.elapsed / 3600


@dataclass(frozen=True)
class ProjectLimits:
    quota: int = 0
    may_borrow: bool = True
    max_running_jobs: int | None = None
    max_running_per_user: int | None = None
    max_gpus_per_job: int | None = None


NO_LIMITS = ProjectLimits()  # a project with no row of limits


@dataclass
class Placement:
    job_id: int
    ranks: list[tuple[int, list[int]]]  # (node id, GPU indices) by rank
    borrowed: bool = False
    warm: list[int] = field(default_factory=list)  # its nodes that hold its cached environment already


@dataclass
class Waiting:
    code: str  # quota, project_limit, user_limit, gpu_type, environment, no_ready_node, capacity, reserved, preempting
    message: str


@dataclass(frozen=True)
class UnreadyNode:
    """A registered node that takes no work now: cordoned, draining, offline, unhealthy, or silent."""

    name: str
    gpu_model: str
    gpu_count: int
    state: str
    reason: str = ""


@dataclass
class Plan:
    placements: list[Placement] = field(default_factory=list)
    preemptions: dict[int, int] = field(default_factory=dict)  # attempt id -> the job it makes room for
    waiting: dict[int, Waiting] = field(default_factory=dict)


# --- the fleet's free GPUs, indexed for best fit ---------------------------------


class FleetIndex:
    """Free GPUs per node, bucketed by GPU model and free count, so best fit is a
    few set looks rather than a scan of every node."""

    def __init__(self, nodes: Iterable[FreeNode]):
        self.nodes = {n.node_id: n for n in nodes}
        self.free = {n.node_id: sorted(n.free) for n in self.nodes.values()}
        size: dict[str, int] = defaultdict(int)
        for n in self.nodes.values():
            size[n.gpu_model] = max(size[n.gpu_model], n.gpu_count, len(n.free))
        self.buckets: dict[str, list[set[int]]] = {model: [set() for _ in range(c + 1)] for model, c in size.items()}
        for n in self.nodes.values():
            self.buckets[n.gpu_model][len(self.free[n.node_id])].add(n.node_id)

    def models(self, request: Request) -> list[str]:
        return [request.gpu_type] if request.gpu_type else sorted(self.buckets)

    def fitting(self, request: Request, allowed: Callable[[int], bool] | None = None) -> list[int]:
        """`request.nodes` node ids of one GPU model that fit one rank each, best fit
        (fewest free GPUs, then lowest id); fewer when they do not exist."""
        best: list[tuple[int, int]] = []
        for model in self.models(request):
            found = self._fitting(model, request, allowed)
            if len(found) == request.nodes and (len(best) < request.nodes or found < best):
                best = found
        return [i for _, i in best]

    def _fitting(self, model: str, request: Request, allowed) -> list[tuple[int, int]]:
        found: list[tuple[int, int]] = []
        buckets = self.buckets.get(model, [])
        for count in range(request.gpus, len(buckets)):
            ids, need = buckets[count], request.nodes - len(found)
            if not ids:
                continue
            if allowed is None and not request.environment and not request.env_key:
                chosen = sorted(ids) if len(ids) <= need else heapq.nsmallest(need, ids)
            else:
                chosen = [i for i in sorted(ids) if self._ok(i, request, allowed)]
                if request.env_key:  # as good a fit otherwise: warm-cache affinity (sort is stable)
                    chosen.sort(key=lambda i: request.env_key not in self.nodes[i].cached)
                chosen = chosen[:need]
            found.extend((count, i) for i in chosen)
            if len(found) >= request.nodes:
                break
        return found

    def _ok(self, node_id: int, request: Request, allowed) -> bool:
        return request.matches(self.nodes[node_id]) and (allowed is None or allowed(node_id))

    def take(self, node_id: int, count: int) -> list[int]:
        gpus, rest = self.free[node_id][:count], self.free[node_id][count:]
        self._move(node_id, rest)
        return gpus

    def give(self, node_id: int, gpus: list[int]) -> None:
        if node_id in self.free:
            self._move(node_id, sorted(self.free[node_id] + gpus))

    def _move(self, node_id: int, free: list[int]) -> None:
        model = self.nodes[node_id].gpu_model
        self.buckets[model][len(self.free[node_id])].discard(node_id)
        self.free[node_id] = free
        self.buckets[model][len(free)].add(node_id)


def place_gang(request: Request, index: FleetIndex, allowed=None) -> list[tuple[int, list[int]]] | None:
    """All ranks at once or none: `request.nodes` distinct nodes with `request.gpus` free each."""
    chosen = index.fitting(request, allowed)
    if len(chosen) < request.nodes:
        return None
    return [(node_id, index.take(node_id, request.gpus)) for node_id in chosen]


def place(request: Request, nodes: list[FreeNode]) -> tuple[int, list[int]] | None:
    """The node and GPU indices for a one-node request, or None (best fit: the node
    with the fewest free GPUs that fits, so a small job does not break into an empty node)."""
    ranks = place_gang(request, FleetIndex(nodes))
    return ranks[0] if ranks else None


# --- one pass ---------------------------------------------------------------------


@dataclass
class Reservation:
    """A blocked job's estimated start and the nodes it will use then; backfill must not delay it."""

    job_id: int
    start: float
    spare: dict[int, int]  # node id -> GPUs free at `start` beyond what the job needs there

    def allows(self, node_id: int, gpus: int, runtime: float) -> bool:
        if node_id not in self.spare or runtime <= self.start:
            return True
        return self.spare[node_id] >= gpus

    def use(self, ranks: list[tuple[int, list[int]]], runtime: float) -> None:
        """A job started beside this reservation: what it holds past the start is spare no more."""
        if runtime > self.start:
            for node_id, gpus in ranks:
                if node_id in self.spare:
                    self.spare[node_id] -= len(gpus)


class Pass:
    def __init__(self, nodes, running, projects):
        self.index = FleetIndex(nodes)
        self.running = list(running)
        self.projects = projects
        self.plan = Plan()
        self.reservations: list[Reservation] = []
        self.gpus_used: dict[int, int] = defaultdict(int)
        self.jobs_running: dict[int, int] = defaultdict(int)
        self.user_running: dict[tuple[int, int], int] = defaultdict(int)
        for a in self.running:
            self.count(a.project_id, a.user_id, a.gpus)
        self.never_fits: dict[Request, Waiting | None] = {}
        self.full: set[Request] = set()  # shapes that found no free GPUs this pass
        self.no_victims: set[tuple] = set()
        self.settled: dict[tuple, Waiting] = {}  # shapes whose jobs can only wait now: why they wait
        self.runtimes: dict[int, float] = {}

    def count(self, project_id: int, user_id: int, gpus: int) -> None:
        self.gpus_used[project_id] += gpus
        self.jobs_running[project_id] += 1
        self.user_running[(project_id, user_id)] += 1

    def limits(self, job: QueuedJob) -> ProjectLimits:
        return self.projects.get(job.project_id) or NO_LIMITS

    def within_quota(self, job: QueuedJob, limits: ProjectLimits) -> bool:
        return self.gpus_used[job.project_id] + job.request.total <= limits.quota

    def limit_reason(self, job: QueuedJob, limits: ProjectLimits) -> Waiting | None:
        if limits.max_gpus_per_job is not None and job.request.total > limits.max_gpus_per_job:
            allowed = limits.max_gpus_per_job
            return Waiting("project_limit", f"asks for {job.request.total} GPUs; the project allows {allowed} a job")
        if limits.max_running_jobs is not None and self.jobs_running[job.project_id] >= limits.max_running_jobs:
            return Waiting("project_limit", f"the project runs {limits.max_running_jobs} jobs, its limit")
        per_user = limits.max_running_per_user
        if per_user is not None and self.user_running[(job.project_id, job.user_id)] >= per_user:
            return Waiting("user_limit", f"its user runs {per_user} jobs in this project, the limit per user")
        return None

    def run(self, jobs: list[QueuedJob]) -> Plan:
        later = []
        for job in jobs:  # guaranteed quota first, in priority order
            limits = self.limits(job)
            if self.limit_reason(job, limits) is None and self.within_quota(job, limits):
                self.consider(job, borrowing=False)
            else:
                later.append((job, limits))
        for job, limits in later:  # then what borrows idle GPUs, in priority order
            if reason := self.limit_reason(job, limits):
                self.plan.waiting[job.job_id] = reason
            elif (within := self.within_quota(job, limits)) or limits.may_borrow:
                self.consider(job, borrowing=not within)
            else:
                self.plan.waiting[job.job_id] = Waiting(
                    "quota", f"the project's quota of {limits.quota} GPUs is in use"
                )
        return self.plan

    def consider(self, job: QueuedJob, borrowing: bool) -> None:
        request = job.request
        key = (request, job.rank, job.may_preempt, borrowing, job.project_id)
        if (settled := self.settled.get(key)) is not None and not job.avoid:
            self.plan.waiting[job.job_id] = settled
            return
        if (never := self.unplaceable(request)) is not None:
            self.plan.waiting[job.job_id] = never
            return
        if job.avoid or request not in self.full:
            ranks = place_gang(request, self.index, self.allowed(job))
            if ranks is not None:
                for reservation in self.reservations:
                    reservation.use(ranks, job.runtime)
                warm = [n for n, _ in ranks if request.env_key and request.env_key in self.index.nodes[n].cached]
                self.plan.placements.append(Placement(job.job_id, ranks, borrowing, warm))
                self.runtimes[job.job_id] = job.runtime
                self.count(job.project_id, job.user_id, request.total)
                return
            if self.reservations and len(self.index.fitting(request)) >= request.nodes:
                blocker = self.reservations[0].job_id
                self.plan.waiting[job.job_id] = Waiting("reserved", f"starting now would delay job {blocker}")
                return
            if not job.avoid:  # a job that avoids nodes says nothing of what the shape finds elsewhere
                self.full.add(request)  # GPUs only get fewer during a pass
        if not self.preempt_for(job, borrowing):
            self.reserve(job)
            if not job.avoid and len(self.reservations) >= MAX_RESERVATIONS:
                # Its shape found no free GPUs and no victims, and no reservation is left to
                # make: all three only get fewer during a pass, so every later job of this
                # key (most of a long queue on a busy fleet) ends here too, as this one did.
                self.settled[key] = self.plan.waiting[job.job_id]

    def allowed(self, job: QueuedJob):
        check = self.backfill_check(job)
        if not job.avoid:
            return check
        return lambda node_id: node_id not in job.avoid and (check is None or check(node_id))

    def backfill_check(self, job: QueuedJob):
        if not self.reservations:
            return None
        runtime, gpus = job.runtime, job.request.gpus
        return lambda node_id: all(r.allows(node_id, gpus, runtime) for r in self.reservations)

    def unplaceable(self, request: Request) -> Waiting | None:
        """Why no node set could ever run the request (even with the fleet empty), else None."""
        if request not in self.never_fits:
            self.never_fits[request] = never_fits(request, self.index.nodes.values())
        return self.never_fits[request]

    def reserve(self, job: QueuedJob) -> None:
        request = job.request
        what = f"{request.gpus} x {request.gpu_type or 'any'} GPU" + (
            f" on each of {request.nodes} nodes at once" if request.nodes > 1 else " on one node"
        )
        self.plan.waiting[job.job_id] = Waiting("capacity", f"waiting for {what}")
        if len(self.reservations) >= MAX_RESERVATIONS:
            return
        found = shadow(request, self.index, self.releases())
        if found is not None:
            self.reservations.append(Reservation(job.job_id, *found))

    def releases(self) -> list[tuple[float, int, int]]:
        out = [(a.remaining, n, len(g)) for a in self.running for n, g in a.placement]
        return out + [(self.runtimes[p.job_id], n, len(g)) for p in self.plan.placements for n, g in p.ranks]

    # --- preemption ---------------------------------------------------------------

    def victims_allowed(self, job: QueuedJob, borrowing: bool) -> list[RunningAttempt]:
        """Who this job may stop: lower classes' preemptible attempts (if its class may
        preempt), and, for a job within its quota, what other projects borrowed."""
        out = []
        for a in self.running:
            by_priority = job.may_preempt and a.preemptible and a.rank < job.rank and (not borrowing or a.borrowed)
            reclaim = not borrowing and a.borrowed and a.project_id != job.project_id
            if a.preempting or by_priority or reclaim:
                out.append(a)
        return out

    def preempt_for(self, job: QueuedJob, borrowing: bool) -> bool:
        # Victims only get fewer during a pass: a shape that found none finds none again.
        key = (job.request, job.rank, job.may_preempt, borrowing, job.project_id)
        if key in self.no_victims:
            return False
        victims = self.victims_allowed(job, borrowing)
        chosen = choose_victims(job.request, self.index, victims) if victims else None
        if chosen is None:
            self.no_victims.add(key)
            return False
        nodes, stopping = chosen
        for a in stopping:
            if not a.preempting:
                self.plan.preemptions[a.attempt_id] = job.job_id
                a.preempting = True
        for node_id in nodes:  # hold what is free there for this job
            self.index.take(node_id, len(self.index.free[node_id]))
        gone = {a.attempt_id for a in stopping}
        self.running = [a for a in self.running if a.attempt_id not in gone]
        n = len(stopping)
        self.plan.waiting[job.job_id] = Waiting("preempting", f"waiting for {n} preempted attempt(s) to stop")
        return True


def mark_borrowed(running: list[RunningAttempt], projects: dict[int, ProjectLimits]) -> None:
    """Which running attempts hold borrowed GPUs: per project, the oldest fill its quota
    (`running` comes oldest first); the rest borrow, and are taken back first."""
    used: dict[int, int] = defaultdict(int)
    for a in running:
        used[a.project_id] += a.gpus
        quota = projects[a.project_id].quota if a.project_id in projects else 0
        a.borrowed = used[a.project_id] > quota


def never_fits(request: Request, nodes) -> Waiting | None:
    typed = [n for n in nodes if not request.gpu_type or n.gpu_model == request.gpu_type]
    if not typed and not request.gpu_type:
        return Waiting("no_ready_node", "no node is ready")
    if not typed:
        return Waiting("gpu_type", f"no ready node has {request.gpu_type} GPUs")
    envs = [n for n in typed if request.matches(n)]
    if not envs:
        where = f"{request.gpu_type} node" if request.gpu_type else "node"
        return Waiting("environment", f"no ready {where} runs environment {request.environment!r}")
    big = [n for n in envs if n.gpu_count >= request.gpus]
    if len(big) < request.nodes:
        what = f"{request.nodes} nodes" if request.nodes > 1 else "a node"
        kind = f"{request.gpu_type} " if request.gpu_type else ""
        return Waiting("gpu_type", f"no {what} with {request.gpus} {kind}GPUs each is ready")
    return None


NEVER_FITS_CODES = ("no_ready_node", "gpu_type", "environment")


def not_ready_detail(request: Request, waiting: Waiting, unready: list[UnreadyNode]) -> Waiting:
    """A job no ready node can run, told with the nodes that could once they are back
    (how many, in which state, and why), so a user sees it waits on a cordon, not on a typo."""
    if waiting.code not in NEVER_FITS_CODES:
        return waiting
    could = [n for n in unready if (not request.gpu_type or n.gpu_model == request.gpu_type)]
    could = [n for n in could if n.gpu_count >= request.gpus]
    if not could:
        return waiting
    by_state: dict[str, int] = defaultdict(int)
    for n in could:
        by_state[n.state] += 1
    counts = ", ".join(f"{count} {state}" for state, count in sorted(by_state.items()))
    shown = "; ".join(f"{n.name} {n.state}" + (f": {n.reason}" if n.reason else "") for n in could[:3])
    more = f"; and {len(could) - 3} more" if len(could) > 3 else ""
    return Waiting(
        "no_ready_node", f"{waiting.message}: {len(could)} that could are not ready ({counts}): {shown}{more}"
    )


def refused_detail(request: Request, waiting: Waiting, refusals: dict[str, list[str]]) -> Waiting:
    """A job waiting for an environment that nodes were asked to run but refused (its Python does
    not run as a job uid there): told with where and why, so the operator knows what to fix."""
    told = refusals.get(request.environment) if waiting.code == "environment" else None
    if not told:
        return waiting
    return Waiting(waiting.code, f"{waiting.message}; refused by {'; '.join(told[:3])}")


def choose_victims(request: Request, index: FleetIndex, candidates: list[RunningAttempt]):
    """The cheapest set of attempts to stop (fewest GPU-hours lost, those already
    stopping cost nothing) so the request fits: per node, take victims cheapest
    first until enough GPUs are free; then the cheapest `request.nodes` nodes."""
    on_node: dict[int, list[RunningAttempt]] = defaultdict(list)
    for a in candidates:
        for node_id, _ in a.placement:
            on_node[node_id].append(a)
    options = []
    for node_id, node in index.nodes.items():
        if not request.matches(node) or node.gpu_count < request.gpus:
            continue
        free = len(index.free[node_id])
        taken, cost = [], 0.0
        for a in sorted(on_node.get(node_id, []), key=lambda a: (not a.preempting, a.cost, a.attempt_id)):
            if free >= request.gpus:
                break
            free += sum(len(g) for n, g in a.placement if n == node_id)
            taken.append(a)
            cost += 0.0 if a.preempting else a.cost
        if free >= request.gpus:
            options.append((cost, node_id, taken))
    if len(options) < request.nodes:
        return None
    options.sort(key=lambda o: (o[0], o[1]))
    best = options[: request.nodes]
    stopping = list({a.attempt_id: a for _, _, taken in best for a in taken}.values())
    return [node_id for _, node_id, _ in best], stopping


def shadow(request: Request, index: FleetIndex, releases: list[tuple[float, int, int]]):
    """When the request would fit if nothing else started (running work ending at its
    max runtime), and the spare GPUs of the nodes it would use then."""
    free = {i: len(f) for i, f in index.free.items() if request.matches(index.nodes[i])}
    ready = {i for i, c in free.items() if c >= request.gpus}
    for t, node_id, gpus in sorted(r for r in releases if r[1] in free):
        free[node_id] += gpus
        if free[node_id] >= request.gpus:
            ready.add(node_id)
        if len(ready) >= request.nodes:
            fits = sorted((free[i], i) for i in ready)[: request.nodes]
            return t, {i: c - request.gpus for c, i in fits}
    return None


def plan(
    jobs: list[QueuedJob],
    nodes: list[FreeNode],
    running: list[RunningAttempt] = (),
    projects: dict[int, ProjectLimits] | None = None,
) -> Plan:
    """One scheduling pass. `jobs` come in queue order (class rank, then place in the queue)."""
    return Pass(nodes, running, projects or {}).run(jobs)


def estimate_starts(
    jobs: list[QueuedJob], nodes: list[FreeNode], running: list[RunningAttempt] = ()
) -> dict[int, float | None]:
    """Seconds from now until each waiting job should start, taking them in queue order
    with running work ending at its max runtime (so an upper bound); None: not on this fleet."""
    index = FleetIndex(nodes)
    releases = [(a.remaining, n, g) for a in running for n, g in a.placement]
    heapq.heapify(releases)
    now, out, never = 0.0, {}, {}
    for job in jobs:
        if job.request not in never:
            never[job.request] = never_fits(job.request, index.nodes.values())
        if never[job.request] is not None:
            out[job.job_id] = None
            continue
        ranks = place_gang(job.request, index)
        while ranks is None and releases:
            now, node_id, gpus = heapq.heappop(releases)
            index.give(node_id, gpus)
            ranks = place_gang(job.request, index)
        out[job.job_id] = now if ranks is not None else None
        for node_id, gpus in ranks or []:
            heapq.heappush(releases, (now + job.runtime, node_id, gpus))
    return out
