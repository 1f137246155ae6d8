"""Prometheus metrics: `/metrics`.

Two sources, one scrape:

- **The database, read per scrape** (`DatabaseCollector`): the fleet, the queue, job and
  attempt counters, start latency and hand-off gap histograms, log lines stored. Every web
  process reads the same rows, so a scrape answered by any of them says the same, and
  agents on other machines need no scrape of their own. The cost is bounded: a few
  GROUP BYs, one pass over nodes and GPUs, and attempt histograms that only read attempts
  not yet counted (`AttemptTotals`: an ended attempt never changes again).
- **What a process measures itself** (API request durations, scheduler passes): counted
  in prometheus-client's multiprocess files (`PROMETHEUS_MULTIPROC_DIR`, set in settings),
  which every process of one machine writes and the scrape sums.

GPU series use dcgm-exporter's names and labels (`DCGM_FI_DEV_GPU_UTIL{gpu, UUID,
modelName, Hostname}`) where they mean the same, so its dashboards and alerts apply. They
are most of a scrape (80,000 samples at 1,000 nodes x 8 GPUs), so `GpuSeries` writes them
in the text format itself; everything else goes through prometheus-client's families.
"""

import functools
import ipaddress
import json
import secrets
import threading
import time
from collections import Counter

from django.conf import settings
from django.db import connection
from django.db.models import Count, Max, Min
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from prometheus_client import CollectorRegistry, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from fleet.gpus import THROTTLE_BITS
from fleet.models import GPU, Node, NodeState
from jobs import egress
from jobs.models import ACTIVE_ATTEMPT_STATES, FINAL_JOB_STATES, Attempt, Job, JobState, LogLine
from portal import metricstoken

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600)
HANDOFF_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)

# Measured in the process where it happens (multiprocess mode sums them per machine).
API_DURATION = Histogram(
    "hangar_http_request_duration_seconds",
    "Time to answer a request, by route pattern.",
    ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
SCHEDULER_PASS = Histogram(
    "hangar_scheduler_pass_duration_seconds",
    "Time of one scheduling pass.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

THROTTLE_MASK = {name: bit for bit, name in THROTTLE_BITS.items()}


# --- the scrape -----------------------------------------------------------------


def metrics_view(request: HttpRequest) -> HttpResponse:
    if not scrape_allowed(request):
        response = HttpResponse(
            "metrics: send the scrape token as 'Authorization: Bearer <token>' (HANGAR_METRICS_TOKEN, "
            "or the token `manage.py up` printed at first start, kept in $HANGAR_DATA_DIR/metrics_token)\n",
            status=401,
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(render(), content_type=CONTENT_TYPE_LATEST)


def render() -> bytes:
    nodes = list(Node.objects.values_list("pk", "name", "state", "gpu_model", "last_heartbeat_at"))
    gpus = GpuSeries({pk: (name, state) for pk, name, state, *_ in nodes}).read()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    registry.register(DatabaseCollector(nodes, gpus))
    return generate_latest(registry) + gpus.text().encode()


def scrape_allowed(request: HttpRequest) -> bool:
    """The scrape token, always; an address only where an operator listed it in
    HANGAR_METRICS_ALLOW (none by default: jobs of network `host` share this host's loopback)."""
    token = metricstoken.current()  # generated here where `manage.py up` did not make it
    given = request.headers.get("Authorization", "")
    if token and given.startswith("Bearer "):
        if secrets.compare_digest(given.removeprefix("Bearer ").strip().encode(), token.encode()):
            return True
    allowed = settings.HANGAR_METRICS_ALLOW
    if not allowed:
        return False
    # Through a proxy on an allowed address (nginx on 127.0.0.1), the client it forwards must
    # be allowed too: every address on the way, never only the last hop.
    forwarded = [a.strip() for a in request.headers.get("X-Forwarded-For", "").split(",") if a.strip()]
    hops = [request.META.get("REMOTE_ADDR", ""), *forwarded]
    return all(address_allowed(hop, allowed) for hop in hops)


def address_allowed(address: str, allowed: list[str]) -> bool:
    try:
        return egress.listed(ipaddress.ip_address(address), allowed)
    except ValueError:
        return False


class RequestMetricsMiddleware:
    """Times every request by its route pattern (never the raw path: one series per route)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        # DRF's routers give regular expressions: their anchors are no part of the route's name.
        route = "/" + match.route.replace("^", "").rstrip("$") if match is not None and match.route else "unmatched"
        API_DURATION.labels(request.method, route, str(response.status_code)).observe(time.perf_counter() - started)
        return response


# --- what the database says -------------------------------------------------------


class DatabaseCollector:
    def __init__(self, nodes: list[tuple], gpus: "GpuSeries"):
        self.nodes, self.gpus = nodes, gpus

    def collect(self):
        now = timezone.now()
        yield from node_metrics(self.nodes, now)
        yield self.gpus.family()
        yield from queue_metrics(now)
        yield from job_metrics()
        yield from TOTALS.metrics()
        lines = LogLine.objects.aggregate(m=Max("pk"))["m"] or 0
        yield CounterMetricFamily("hangar_log_lines_ingested", "Log lines stored (ever).", value=lines)


def node_metrics(nodes: list[tuple], now):
    by_state = GaugeMetricFamily("hangar_nodes", "Nodes by state and GPU model.", labels=["state", "gpu_model"])
    counts = Counter((state, model) for _, _, state, model, _ in nodes)
    for model in sorted({n[3] for n in nodes}):
        for state in NodeState.values:
            by_state.add_metric([state, model], counts[(state, model)])
    yield by_state
    info = GaugeMetricFamily("hangar_node_info", "One per node, with its state.", labels=["node", "state", "gpu_model"])
    age = GaugeMetricFamily(
        "hangar_node_heartbeat_age_seconds", "Seconds since the node's agent was heard from.", labels=["node"]
    )
    for _, name, state, model, beat in nodes:
        info.add_metric([name, state, model], 1)
        if beat is not None:
            age.add_metric([name], (now - beat).total_seconds())
    yield info
    yield age


GPU_SERIES = [
    # (dcgm-exporter's name, its help, the column of fleet_gpu)
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "utilization_pct"),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "memory_used_mb"),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", None),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w"),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz"),
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "Throttle reasons (NVML bitmask).", None),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered (0: none).", "last_xid"),
    # Gauges, as dcgm-exporter has them (a volatile count starts again at a reboot).
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Uncorrectable ECC errors since boot.", "ecc_uncorrected_volatile"),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Uncorrectable ECC errors, lifetime.", "ecc_uncorrected_aggregate"),
]
GPU_COLUMNS = [
    "node_id",
    "index",
    "uuid",
    "model",
    "memory_total_mb",
    "throttle_reasons",
    "lost",
    "utilization_pct",
    "memory_used_mb",
    "temperature_c",
    "power_w",
    "sm_clock_mhz",
    "last_xid",
    "ecc_uncorrected_volatile",
    "ecc_uncorrected_aggregate",
]


class GpuSeries:
    """Every GPU's series, dcgm-exporter style, read in one query.

    At 1,000 nodes x 8 GPUs these are 80,000 samples: through metric families and
    `generate_latest` they cost about 1.5 s a scrape (label escaping and validation per
    sample, measured by bench/metrics.py), so this block is written here in the same text
    format, each GPU's labels escaped once. The scrape test parses it with
    prometheus-client's parser."""

    def __init__(self, nodes: dict[int, tuple[str, str]]):
        self.nodes = nodes
        self.states: Counter = Counter()
        self.lines: dict[str, list[str]] = {name: [] for name, _, _ in GPU_SERIES}

    def read(self) -> "GpuSeries":
        busy = busy_gpus()
        table = connection.ops.quote_name(GPU._meta.db_table)
        columns = ", ".join(connection.ops.quote_name(GPU._meta.get_field(c).column) for c in GPU_COLUMNS)
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {columns} FROM {table}")
            for row in cursor.fetchall():
                self.add(row, busy)
        return self

    def add(self, row: tuple, busy: set) -> None:
        node_id, index, uuid, model, total, reasons, lost, util, used, temp, power, clock, xid, vol, agg = row
        name, node_state = self.nodes.get(node_id, ("?", "?"))
        self.states[(gpu_state(node_state, bool(lost), (node_id, index) in busy), model)] += 1
        labels = gpu_labels(index, uuid, model, name)
        if isinstance(reasons, str):
            reasons = json.loads(reasons) if reasons != "[]" else ()
        mask = sum(THROTTLE_MASK.get(r, 0) for r in reasons or ())
        free = None if used is None else total - used
        values = (util, used, free, temp, power, clock, mask, xid or 0, vol, agg)
        for (series, _, _), value in zip(GPU_SERIES, values, strict=True):
            if value is not None:
                self.lines[series].append(f"{series}{labels}{value}\n")

    def text(self) -> str:
        out = []
        for name, doc, _ in GPU_SERIES:
            out.append(f"# HELP {name} {doc}\n# TYPE {name} gauge\n")
            out.extend(self.lines[name])
        return "".join(out)

    def family(self) -> GaugeMetricFamily:
        by_state = GaugeMetricFamily("hangar_gpus", "GPUs by state and model.", labels=["state", "gpu_model"])
        for (state, model), count in sorted(self.states.items()):
            by_state.add_metric([state, model], count)
        return by_state


@functools.lru_cache(maxsize=65536)
def gpu_labels(index: int, uuid: str, model: str, node: str) -> str:
    """A GPU's label set as text, escaped once per process (not per scrape)."""
    return f'{{gpu="{index}",UUID="{escape(uuid)}",modelName="{escape(model)}",Hostname="{escape(node)}"}} '


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def gpu_state(node_state: str, lost: bool, busy: bool) -> str:
    """busy (an attempt holds it), free (on a ready node), lost, or the node's state."""
    if lost:
        return "lost"
    if busy:
        return "busy"
    return "free" if node_state == NodeState.READY else node_state


def busy_gpus() -> set[tuple[int, int]]:
    held = set()
    rows = Attempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES).values_list("node_id", "gpu_indices", "placement")
    for node_id, indices, placement in rows:
        ranks = placement or [{"node_id": node_id, "gpus": indices}]
        held.update((rank["node_id"], gpu) for rank in ranks for gpu in rank["gpus"])
    return held


def queue_metrics(now):
    queued = Job.objects.filter(state=JobState.QUEUED)
    waiting = GaugeMetricFamily(
        "hangar_queue_waiting_jobs", "Queued jobs by priority class and project.", labels=["priority", "project"]
    )
    oldest = GaugeMetricFamily(
        "hangar_queue_oldest_wait_seconds", "How long the longest-waiting job has waited.", labels=["priority"]
    )
    for row in queued.values("priority", "project__slug").annotate(n=Count("pk"), first=Min("queued_at")):
        waiting.add_metric([row["priority"], row["project__slug"]], row["n"])
    for row in queued.values("priority").annotate(first=Min("queued_at")):
        oldest.add_metric([row["priority"]], (now - row["first"]).total_seconds())
    yield waiting
    yield oldest
    yield from reason_metrics()


REASONS_EVERY_SECONDS = 15.0
_reasons: tuple[float, Counter] = (0.0, Counter())


def reason_metrics():
    """Why queued jobs wait, as the queue page says. That is a dry run of the next pass
    (about 100 ms at 1,000 nodes), so a process redoes it at most every 15 s."""
    global _reasons
    from jobs.scheduler import queue_report  # the scheduler imports this module for its pass timer

    at, counts = _reasons
    if time.monotonic() - at > REASONS_EVERY_SECONDS:
        rows, _ = queue_report()
        counts = Counter(r["reason"]["code"] for r in rows)
        _reasons = (time.monotonic(), counts)
    family = GaugeMetricFamily("hangar_queue_waiting_by_reason", "Queued jobs by why they wait.", labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    yield family


def job_metrics():
    """Jobs submitted (by class), ended (by outcome and failure class) and by state now: one GROUP BY."""
    rows = Job.objects.values_list("state", "failure_class", "priority").annotate(n=Count("pk")).order_by()
    submitted, finished, states = Counter(), Counter(), Counter()
    for state, failure_class, priority, n in rows:
        submitted[priority] += n
        states[state] += n
        if state in FINAL_JOB_STATES:
            finished[(state, failure_class or "none")] += n
    family = CounterMetricFamily("hangar_jobs_submitted", "Jobs submitted, by priority class.", labels=["priority"])
    for priority, n in sorted(submitted.items()):
        family.add_metric([priority], n)
    yield family
    doc = "Jobs ended, by outcome and failure class."
    family = CounterMetricFamily("hangar_jobs_finished", doc, labels=["outcome", "failure_class"])
    for (state, failure_class), n in sorted(finished.items()):
        family.add_metric([state, failure_class], n)
    yield family
    family = GaugeMetricFamily("hangar_jobs", "Jobs by state now.", labels=["state"])
    for state in JobState.values:
        family.add_metric([state], states[state])
    yield family


class AttemptTotals:
    """Attempt counters and histograms, kept per process and added to from the attempts
    that ended since the last scrape: an attempt at or below the watermark (the id just
    below the oldest attempt still live) never changes again, so each is read once.
    Attempts above it are read afresh every scrape (the live ones and those after them:
    few, since an unstarted attempt is ended within HANGAR_START_TIMEOUT_SECONDS)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.watermark = 0
        self.settled = Tally()

    def metrics(self):
        with self.lock:
            live_from = Attempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES).aggregate(m=Min("pk"))["m"]
            top = Attempt.objects.aggregate(m=Max("pk"))["m"] or 0
            watermark = top if live_from is None else live_from - 1
            if watermark > self.watermark:
                self.settled.add_rows(attempt_rows(self.watermark, watermark))
                self.watermark = watermark
            tally = self.settled.copy()
        tally.add_rows(attempt_rows(watermark, None))
        return tally.families()


def attempt_rows(after: int, upto: int | None):
    """(state, failure_class, start latency s, hand-off gap s) of the attempts in (after, upto],
    streamed (a process's first scrape reads every ended attempt once)."""
    rows = Attempt.objects.filter(pk__gt=after)
    if upto is not None:
        rows = rows.filter(pk__lte=upto)
    sql, params = rows.values_list("pk").query.sql_with_params()
    table = connection.ops.quote_name(Attempt._meta.db_table)
    latency, handoff = seconds_between("queued_at", "running_at"), seconds_between("scheduled_at", "started_at")
    query = f"SELECT state, failure_class, {latency}, {handoff} FROM {table} WHERE id IN ({sql})"
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        while chunk := cursor.fetchmany(10000):
            yield from chunk


def seconds_between(start: str, end: str) -> str:
    """Seconds from one timestamp column to another, in the database's own arithmetic
    (Django's duration expressions call back into Python per row on SQLite)."""
    if connection.vendor == "postgresql":
        # EXTRACT gives numeric (Decimal in Python) since PostgreSQL 14: summed as a float.
        return f"CAST(EXTRACT(EPOCH FROM ({end} - {start})) AS double precision)"
    return f"(julianday({end}) - julianday({start})) * 86400.0"


class Tally:
    def __init__(self):
        self.started: Counter = Counter()
        self.ended: Counter = Counter()
        self.latency = Buckets(LATENCY_BUCKETS)
        self.handoff = Buckets(HANDOFF_BUCKETS)

    def copy(self) -> "Tally":
        other = Tally()
        other.started, other.ended = Counter(self.started), Counter(self.ended)
        other.latency, other.handoff = self.latency.copy(), self.handoff.copy()
        return other

    def add_rows(self, rows) -> None:
        for state, failure_class, latency, handoff in rows:
            if handoff is not None:
                self.started["all"] += 1
                self.handoff.observe(handoff)
            if latency is not None:
                self.latency.observe(latency)
            if state not in ACTIVE_ATTEMPT_STATES:
                self.ended[(state, failure_class or "none")] += 1

    def families(self):
        started = CounterMetricFamily("hangar_attempts_started", "Attempts an agent took.", value=self.started["all"])
        doc = "Attempts ended, by outcome and failure class."
        ended = CounterMetricFamily("hangar_attempts_finished", doc, labels=["outcome", "failure_class"])
        for (state, failure_class), n in sorted(self.ended.items()):
            ended.add_metric([state, failure_class], n)
        yield started
        yield ended
        yield self.latency.family(
            "hangar_job_start_latency_seconds", "From queued to the command running, per attempt."
        )
        yield self.handoff.family(
            "hangar_attempt_handoff_gap_seconds", "From placed by the scheduler to taken by the node's agent."
        )


class Buckets:
    def __init__(self, bounds):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def copy(self) -> "Buckets":
        other = Buckets(self.bounds)
        other.counts, other.sum = list(self.counts), self.sum
        return other

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts, strict=True):
            total += count
            cumulative.append((bound, total))
        return HistogramMetricFamily(name, doc, buckets=cumulative, sum_value=self.sum)


TOTALS = AttemptTotals()


def reset() -> None:
    """Forget what this process remembers (tests: a rolled-back database hands out ids again)."""
    global TOTALS, _reasons
    TOTALS, _reasons = AttemptTotals(), (0.0, Counter())
