"""Checks run on a node before a job's command starts, and the burn-in before a node returns to service.

Each check is a short function over what the node reports now (a Context): the
agent fills it from its GPU provider (agent/preflight.py, which runs a job's
preflight and rendezvous); the burn-in, run by the portal, fills it from the
latest telemetry the agent stored. Every result is recorded with its duration
and evidence; a failure cordons the node.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db.models import Max
from django.utils import timezone

from fleet import signals
from fleet.gpus import GpuSample
from fleet.models import HealthCheck, Node
from portal import statements
from portal.models import AuditEvent


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


CHECK_COLUMNS = ("node", "attempt", "suite", "name", "passed", "duration_ms", "evidence", "at")


def record(node: Node, results: list[Result], suite: str, attempt=None) -> None:
    """One insert for the whole suite (every short job's preflight writes it)."""
    now = timezone.now()
    attempt_id = attempt.pk if attempt is not None else None
    rows = [(node.pk, attempt_id, suite, r.name, r.passed, r.duration_ms, r.evidence, now) for r in results]
    statements.insert(HealthCheck, CHECK_COLUMNS, rows)


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


def stress_on_node(node: Node) -> Result:
    """The stress step runs where the GPUs are: in this process if it is the node's agent (its
    `stress_here` receiver answers), else sent to the agent's queue by name; its recorded check
    is awaited (the row is the answer)."""
    for _, here in signals.stress_here.send(sender=Node, node_id=node.pk):
        if here is not None:
            return here
    from portal.celery import app

    before = HealthCheck.objects.aggregate(last=Max("pk"))["last"] or 0
    app.send_task("hangar.burn_in_stress", args=[node.pk], queue=node.queue)
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
        AuditEvent.record(by, "node.burn_in_failed", node, reason=reason, detail=evidence)
        return Uncordon(False, f"burn-in failed, {node.name} stays cordoned: {failed}")
    node.uncordon(by, reason, evidence=evidence)
    return Uncordon(True, f"burn-in passed, {node.name} uncordoned")
