"""Checks run on a node before a job's command starts, and the burn-in before a node returns to service.

Each check is a short function over what the node reports now: in the agent
process it asks the GPU provider directly; elsewhere (the burn-in, run by the
portal) it reads the latest telemetry the agent stored. Every result is
recorded with its duration and evidence; a failure cordons the node.
"""

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from fleet.gpus import GpuSample
from fleet.models import HealthCheck, Node


@dataclass
class Context:
    node: Node
    gpu_indices: list[int]
    gpu_type: str
    present: set[int] = field(default_factory=set)
    samples: dict[int, GpuSample] = field(default_factory=dict)
    driver_error: str = ""


@dataclass(frozen=True)
class Result:
    name: str
    passed: bool
    evidence: str
    duration_ms: float = 0.0


def check_devices(ctx: Context) -> tuple[bool, str]:
    missing = sorted(set(ctx.gpu_indices) - ctx.present)
    if missing:
        return False, f"GPU indices {missing} are not present on {ctx.node.name} (it has {sorted(ctx.present)})"
    return True, f"GPUs {ctx.gpu_indices} present"


def check_device_type(ctx: Context) -> tuple[bool, str]:
    if ctx.gpu_type and ctx.node.gpu_model != ctx.gpu_type:
        return False, f"job asks for {ctx.gpu_type}, {ctx.node.name} has {ctx.node.gpu_model}"
    return True, f"{ctx.node.gpu_model} matches {ctx.gpu_type or 'any type'}"


def check_driver(ctx: Context) -> tuple[bool, str]:
    if ctx.driver_error:
        return False, f"the driver did not answer: {ctx.driver_error}"
    lost = [i for i in ctx.gpu_indices if i in ctx.samples and ctx.samples[i].lost]
    if lost:
        return False, f"GPUs {lost} have fallen off the bus"
    return True, f"the driver answered for GPUs {sorted(ctx.samples)}"


def check_ecc(ctx: Context) -> tuple[bool, str]:
    bad = []
    for i in ctx.gpu_indices:
        s = ctx.samples.get(i)
        if s and (s.ecc_uncorrected_volatile or s.retired_pages_pending or s.remapped_rows_pending):
            bad.append(
                f"GPU {i}: {s.ecc_uncorrected_volatile} uncorrectable ECC errors, "
                f"retired pages pending={s.retired_pages_pending}, row remapping pending={s.remapped_rows_pending}"
            )
    return (False, "; ".join(bad)) if bad else (True, "no uncorrectable ECC errors, no pending retired/remapped pages")


def check_temperature(ctx: Context) -> tuple[bool, str]:
    limit = settings.HANGAR_PREFLIGHT_MAX_TEMP_C
    temps = {i: ctx.samples[i].temperature_c for i in ctx.gpu_indices if i in ctx.samples}
    hot = {i: t for i, t in temps.items() if t is not None and t > limit}
    if hot:
        return False, f"GPUs over {limit:g}°C: " + ", ".join(f"GPU {i} {t:g}°C" for i, t in hot.items())
    return True, "temperatures " + ", ".join(f"GPU {i} {t}°C" for i, t in temps.items())


def check_throttle(ctx: Context) -> tuple[bool, str]:
    throttled = {
        i: ctx.samples[i].throttle_reasons
        for i in ctx.gpu_indices
        if i in ctx.samples and (ctx.samples[i].thermal_throttled or ctx.samples[i].power_throttled)
    }
    if throttled:
        return False, "throttling: " + ", ".join(f"GPU {i} {'+'.join(r)}" for i, r in throttled.items())
    return True, "no thermal or power throttling"


CHECKS: list[tuple[str, Callable[[Context], tuple[bool, str]]]] = [
    ("devices", check_devices),
    ("device_type", check_device_type),
    ("driver", check_driver),
    ("ecc", check_ecc),
    ("temperature", check_temperature),
    ("throttle", check_throttle),
]


def run_checks(ctx: Context) -> list[Result]:
    results = []
    for name, check in CHECKS:
        start = time.perf_counter()
        passed, evidence = check(ctx)
        results.append(Result(name, passed, evidence, (time.perf_counter() - start) * 1000))
    return results


def rendezvous_reachable(host: str, port: int, timeout: float = 2.0) -> tuple[bool, str]:
    """For multi-node jobs: can this rank open a TCP connection to the rendezvous address?"""
    start = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, f"{host}:{port} reachable in {(time.perf_counter() - start) * 1000:.0f} ms"
    except OSError as exc:
        return False, f"{host}:{port} unreachable: {exc}"


# --- Multi-node: can the ranks reach rank 0 on the rendezvous port? -------------------------
#
# Rank 0's agent listens on the job's own MASTER_PORT during its preflight, greets
# each connection with the attempt's id, and frees the port for the job once every
# other rank has answered (or its wait ran out). Every other rank connects to
# MASTER_ADDR:MASTER_PORT until it is greeted or its wait runs out. A rank that
# arrives after rank 0's job took the port still reaches the port (the job's own
# store answers the connection), which is what the check is about.

POLL_SECONDS = 0.2


def rendezvous_seconds() -> float:
    return settings.HANGAR_RENDEZVOUS_SECONDS


def run_rendezvous(attempt, rank: int, world_size: int, master_addr: str, port: int, still_current) -> list[str]:
    """Record the rendezvous check of one rank; a rank that cannot reach rank 0 cordons its own
    node (the preflight rule) and fails the attempt (infra). Returns what failed."""
    start = time.perf_counter()
    still_current = at_most_every(still_current, 0.5)  # each look renews the lease: a write
    if rank == 0:
        passed, evidence = listen_for_ranks(attempt.pk, port, world_size - 1, still_current)
    else:
        passed, evidence = reach_rank_zero(attempt.pk, rank, master_addr, port, still_current)
    result = Result("rendezvous", passed, evidence, (time.perf_counter() - start) * 1000)
    record(attempt.node, [result], "preflight", attempt)
    if passed:
        return []
    if rank != 0 and still_current():
        evidence_dict = {"attempt": attempt.pk, "rank": rank, "failed_checks": {"rendezvous": evidence}}
        attempt.node.auto_cordon(f"preflight failed: rendezvous: {evidence}", evidence_dict)
    return [f"rendezvous: {evidence}"]


def at_most_every(check: Callable[[], bool], seconds: float) -> Callable[[], bool]:
    """`check`, called again only once `seconds` have passed; its last answer in between."""
    last = {"at": -seconds, "answer": True}

    def call() -> bool:
        now = time.monotonic()
        if now - last["at"] >= seconds:
            last["at"], last["answer"] = now, check()
        return last["answer"]

    return call


def listen_for_ranks(attempt_id: int, port: int, expected: int, still_current) -> tuple[bool, str]:
    greeting = f"hangar-rendezvous {attempt_id}\n".encode()
    try:
        server = socket.create_server(("", port), reuse_port=False)
    except OSError as exc:  # the job could not bind it either; not the node's health
        return False, f"cannot listen on rendezvous port {port}: {exc}"
    server.settimeout(POLL_SECONDS)
    seen: set[int] = set()
    deadline = time.monotonic() + rendezvous_seconds()
    with server:
        while len(seen) < expected and time.monotonic() < deadline and still_current():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    conn.sendall(greeting)
                    rank = int(conn.recv(64).decode().split()[-1])
                except (OSError, ValueError, IndexError):
                    continue  # not a rank of ours
                if 1 <= rank <= expected:
                    seen.add(rank)
    if not still_current():
        return False, f"the attempt ended (another rank failed, or a cancel) while rank 0 waited on port {port}"
    missing = sorted(set(range(1, expected + 1)) - seen)
    if missing:
        return True, f"listened on port {port}; ranks {missing} did not check in (each records its own check)"
    return True, f"listened on port {port}; ranks {sorted(seen)} reached it"


def reach_rank_zero(attempt_id: int, rank: int, host: str, port: int, still_current) -> tuple[bool, str]:
    deadline = time.monotonic() + rendezvous_seconds()
    error = "no answer"
    tries = 0
    while time.monotonic() < deadline and still_current():
        tries += 1
        try:
            with socket.create_connection((host, port), timeout=2.0) as conn:
                conn.settimeout(1.0)
                try:
                    hello = conn.recv(64).decode()
                except TimeoutError:
                    return True, f"{host}:{port} reachable (the job already listens there), try {tries}"
                if hello.strip() == f"hangar-rendezvous {attempt_id}":
                    conn.sendall(f"rank {rank}\n".encode())
                    return True, f"{host}:{port} reachable, rank 0 answered, try {tries}"
                error = f"something else answered on {host}:{port}: {hello[:40]!r}"
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
        time.sleep(POLL_SECONDS)
    if not still_current():
        return False, "the attempt ended before rank 0 was reached"
    return False, f"{host}:{port} unreachable for {rendezvous_seconds():g}s ({tries} tries): {error}"


def live_context(node: Node, gpu_indices: list[int], gpu_type: str) -> Context:
    """What the node reports now: from this process's agent when there is one, else stored telemetry."""
    from fleet import agent

    ctx = Context(node, gpu_indices, gpu_type)
    current = agent.CURRENT
    if current is not None and current.node is not None and current.node.pk == node.pk:
        start = time.perf_counter()
        try:
            ctx.present = {g.index for g in current.provider.inventory()}
            ctx.samples = {s.index: s for s in current.provider.sample(set(), events=False)}
        except Exception as exc:  # any driver failure is the check's evidence
            ctx.driver_error = f"{type(exc).__name__}: {exc}"
        if time.perf_counter() - start > 10:
            ctx.driver_error = ctx.driver_error or "the driver took over 10 s to answer"
        return ctx
    return stored_context(node, gpu_indices, gpu_type)


def stored_context(node: Node, gpu_indices: list[int], gpu_type: str) -> Context:
    ctx = Context(node, gpu_indices, gpu_type)
    fresh = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_SECONDS)
    for gpu in node.gpus.all():
        ctx.present.add(gpu.index)
        if gpu.sampled_at is None or gpu.sampled_at < fresh:
            continue
        ctx.samples[gpu.index] = GpuSample(
            gpu.index,
            gpu.utilization_pct,
            gpu.memory_used_mb,
            gpu.temperature_c,
            gpu.power_w,
            gpu.sm_clock_mhz,
            tuple(gpu.throttle_reasons),
            gpu.ecc_uncorrected_volatile,
            gpu.ecc_uncorrected_aggregate,
            gpu.retired_pages_pending,
            gpu.remapped_rows_pending,
            lost=gpu.lost,
        )
    stale = sorted(ctx.present - set(ctx.samples))
    if stale:
        ctx.driver_error = f"no telemetry from GPUs {stale} in the last {settings.HANGAR_NODE_OFFLINE_SECONDS:g}s"
    return ctx


def record(node: Node, results: list[Result], suite: str, attempt=None) -> None:
    HealthCheck.objects.bulk_create(
        HealthCheck(
            node=node,
            attempt=attempt,
            suite=suite,
            name=r.name,
            passed=r.passed,
            duration_ms=r.duration_ms,
            evidence=r.evidence,
        )
        for r in results
    )


def run_preflight(attempt, gpu_type: str) -> list[str]:
    """Run and record the preflight of an attempt; a failure cordons the node. Returns what failed."""
    node = attempt.node
    results = run_checks(live_context(node, attempt.gpu_indices, gpu_type))
    record(node, results, "preflight", attempt)
    failures = [f"{r.name}: {r.evidence}" for r in results if not r.passed]
    if failures:
        evidence = {"attempt": attempt.pk, "failed_checks": {r.name: r.evidence for r in results if not r.passed}}
        node.auto_cordon("preflight failed: " + "; ".join(failures), evidence)
    return failures


def burn_in(node: Node) -> tuple[bool, list[Result]]:
    """Before an automatically cordoned node returns to service: the preflight suite over all its GPUs,
    on the telemetry its agent reports now (so a silent agent fails it too)."""
    node.refresh_from_db()
    ctx = stored_context(node, sorted(node.gpus.values_list("index", flat=True)), "")
    results = run_checks(ctx)
    fresh = node.last_heartbeat_at and node.last_heartbeat_at >= timezone.now() - timedelta(
        seconds=settings.HANGAR_NODE_OFFLINE_SECONDS
    )
    results.append(Result("heartbeat", bool(fresh), f"last heartbeat {node.last_heartbeat_at}"))
    record(node, results, "burn-in")
    if not all(r.passed for r in results):
        return False, results  # no point loading GPUs that already fail a check
    results.append(stress_on_node(node))
    return results[-1].passed, results


def stress_here(node_id: int) -> Result | None:
    """Run and record the stress step, if this process is the node's agent (else None)."""
    from fleet import agent, stress

    current = agent.CURRENT
    if current is None or current.node is None or current.node.pk != node_id:
        return None
    node = current.node
    indices = sorted(node.gpus.values_list("index", flat=True))
    start = time.perf_counter()
    try:
        passed, evidence = stress.run(current.provider, node, indices)
    except Exception as exc:  # a driver or subprocess failure is the step's evidence
        passed, evidence = False, f"the stress step failed to run: {type(exc).__name__}: {exc}"
    result = Result("stress", passed, evidence, (time.perf_counter() - start) * 1000)
    record(node, [result], "burn-in")
    return result


def stress_on_node(node: Node) -> Result:
    """The stress step runs where the GPUs are: in this process if it is the node's agent, else
    sent to the agent's queue; its recorded check is awaited (the row is the answer)."""
    here = stress_here(node.pk)
    if here is not None:
        return here
    from fleet.tasks import burn_in_stress

    before = HealthCheck.objects.aggregate(last=Max("pk"))["last"] or 0
    burn_in_stress.apply_async(args=[node.pk], queue=node.queue)
    wait = settings.HANGAR_BURN_IN_WAIT_SECONDS
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        row = HealthCheck.objects.filter(node=node, suite="burn-in", name="stress", pk__gt=before).first()
        if row is not None:
            return Result(row.name, row.passed, row.evidence, row.duration_ms)
        time.sleep(0.25)
    result = Result("stress", False, f"the node's agent did not run the stress step within {wait:g}s", wait * 1000)
    record(node, [result], "burn-in")
    return result


@dataclass(frozen=True)
class Uncordon:
    done: bool
    message: str


def return_to_service(node: Node, by, reason: str, override: bool = False) -> Uncordon:
    """Uncordon a node. One cordoned by a health check or event passes a burn-in first,
    unless an operator overrides it with a written reason (audited as such)."""
    node.refresh_from_db()
    if node.state == "ready":
        return Uncordon(False, f"{node.name} is already ready")
    if not node.auto_cordoned:
        node.uncordon(by, reason)
        return Uncordon(True, f"{node.name} uncordoned")
    if override:
        node.uncordon(by, reason, action="node.uncordon_override", evidence={"burn_in": "skipped by override"})
        return Uncordon(True, f"{node.name} uncordoned without burn-in (override)")
    passed, results = burn_in(node)
    evidence = {"burn_in": {r.name: {"passed": r.passed, "evidence": r.evidence} for r in results}}
    if not passed:
        failed = "; ".join(f"{r.name}: {r.evidence}" for r in results if not r.passed)
        from portal.models import AuditEvent

        AuditEvent.record(by, "node.burn_in_failed", node, reason=reason, detail=evidence)
        return Uncordon(False, f"burn-in failed, {node.name} stays cordoned: {failed}")
    node.uncordon(by, reason, evidence=evidence)
    return Uncordon(True, f"burn-in passed, {node.name} uncordoned")
