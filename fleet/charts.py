"""Plotly figures of a node's telemetry, built in Python and shipped as JSON to the bundled plotly.js."""

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import plotly.graph_objects as go
from django.db.models import Avg, Case, F, IntegerField, Q, Sum, Value, When
from django.utils import timezone
from plotly.subplots import make_subplots

from fleet.models import Node, TelemetrySample

PANELS = [
    ("utilization_pct", "Utilisation (%)"),
    ("temperature_c", "Temperature (°C)"),
    ("power_w", "Power (W)"),
    ("memory_used_mb", "Memory used (MiB)"),
    ("sm_clock_mhz", "SM clock (MHz)"),
]


def bucketed(node: Node, since: datetime) -> dict[int, list[tuple]]:
    """Per GPU, (time, metric values...) over the window: raw samples up to an hour, then averaged
    per minute (up to a day) or per hour in the database, so a day of 5 s samples stays a small reply."""
    span = timezone.now() - since
    names = [name for name, _ in PANELS]
    samples = TelemetrySample.objects.filter(node=node, at__gte=since)
    if span <= timedelta(hours=1, minutes=1):
        rows = samples.order_by("at").values_list("gpu_index", "at", *names)
    else:
        minutes = 1 if span <= timedelta(days=1, minutes=1) else 60
        rows = (
            samples.annotate(bucket=F("epoch_minute") / minutes)
            .values("gpu_index", "bucket")
            .annotate(**{f"avg_{name}": Avg(name) for name in names})
            .order_by("bucket")
            .values_list("gpu_index", "bucket", *[f"avg_{name}" for name in names])
        )
        rows = [(gpu, datetime.fromtimestamp(b * minutes * 60, tz=UTC), *values) for gpu, b, *values in rows]
    out: dict[int, list[tuple]] = {}
    for gpu, at, *values in rows:
        out.setdefault(gpu, []).append((at, *values))
    return out


def node_figure_json(node: Node, since: datetime) -> str:
    series = bucketed(node, since)
    figure = make_subplots(rows=len(PANELS), cols=1, shared_xaxes=True, subplot_titles=[t for _, t in PANELS])
    traces = []
    for gpu, points in sorted(series.items()):
        times = [p[0].isoformat() for p in points]
        for row, _ in enumerate(PANELS, start=1):
            axis = "" if row == 1 else str(row)
            # Our own numbers need no validation; plotly's validator cost seconds at a day of points.
            trace = go.Scattergl(
                x=times,
                y=[p[row] for p in points],
                name=f"GPU {gpu}",
                legendgroup=f"gpu{gpu}",
                showlegend=row == 1,
                mode="lines",
                xaxis=f"x{axis}",
                yaxis=f"y{axis}",
                _validate=False,
            )
            traces.append(trace.to_plotly_json())
    figure.update_layout(height=180 * len(PANELS), margin={"l": 50, "r": 10, "t": 30, "b": 30}, template="plotly_white")
    # The figure's layout (axes, titles) from make_subplots; traces added as JSON, not through
    # Figure.add_traces, which validates every point again.
    return json.dumps({"data": traces, "layout": figure.to_plotly_json()["layout"]}, default=str)


def throttle_seconds(attempts) -> dict[tuple[int, int], tuple[float, float]]:
    """(thermal, power) seconds throttled by (attempt id, node id), for every rank of the attempts
    that ran: one grouped query, whatever the number of attempts and ranks. A sample belongs to
    the attempt whose rank held its GPU at that time (GPUs are never shared, so at most one)."""
    now = timezone.now()
    whens, nodes, windows = [], set(), []
    for attempt in attempts:
        if attempt.running_at is None:
            continue
        until = attempt.finished_at or now
        windows.append((attempt.running_at, until))
        for rank in attempt.ranks:
            nodes.add(rank["node_id"])
            held = Q(node_id=rank["node_id"], gpu_index__in=rank["gpus"], at__gte=attempt.running_at, at__lte=until)
            whens.append(When(held, then=Value(attempt.pk)))
    if not whens:
        return {}
    rows = (
        TelemetrySample.objects.filter(
            node_id__in=nodes, at__gte=min(w[0] for w in windows), at__lte=max(w[1] for w in windows)
        )
        .annotate(attempt_pk=Case(*whens, default=Value(None), output_field=IntegerField()))
        .exclude(attempt_pk=None)
        .order_by()
        .values_list("attempt_pk", "node_id")
        .annotate(thermal=Sum("thermal_throttle_s"), power=Sum("power_throttle_s"))
    )
    return {(pk, node): (thermal or 0.0, power or 0.0) for pk, node, thermal, power in rows}


@dataclass
class RankThrottle:
    rank: int
    node_id: int
    node: str
    thermal_s: float
    power_s: float
    straggler: bool = False

    @property
    def total_s(self) -> float:
        return self.thermal_s + self.power_s


def throttle_by_rank(attempts, node_names: dict[int, str] | None = None) -> dict[int, list[RankThrottle]]:
    """Per attempt that ran, each rank's node and time throttled; in a multi-node attempt the
    node that throttled most is flagged (every rank waits for it)."""
    seconds = throttle_seconds(attempts)
    out = {}
    for attempt in attempts:
        if attempt.running_at is None:
            continue
        ranks = []
        for r in attempt.ranks:
            name = r.get("node") or (node_names or {}).get(r["node_id"]) or attempt.node.name
            thermal, power = seconds.get((attempt.pk, r["node_id"]), (0.0, 0.0))
            ranks.append(RankThrottle(r["rank"], r["node_id"], name, thermal, power))
        if len(ranks) > 1:
            slowest = straggler({r.node: r.total_s for r in ranks})
            for r in ranks:
                r.straggler = r.node == slowest
        out[attempt.pk] = ranks
    return out


def with_throttle_seconds(node: Node, attempts: list) -> list:
    """Annotate attempts (that ran on this node) with the seconds its GPUs spent thermal- and
    power-throttled there, and the straggler of a multi-node attempt."""
    by_rank = throttle_by_rank(attempts, {node.pk: node.name})
    for attempt in attempts:
        ranks = by_rank.get(attempt.pk, [])
        here = [r for r in ranks if r.node_id == node.pk]
        attempt.gpus_here = [g for r in attempt.ranks if r["node_id"] == node.pk for g in r["gpus"]]
        attempt.thermal_s = sum(r.thermal_s for r in here)
        attempt.power_s = sum(r.power_s for r in here)
        attempt.straggler = next((r for r in ranks if r.straggler), None)
    return attempts


def straggler(throttled_s_by_node: dict[str, float]) -> str | None:
    """In a multi-node job every rank waits for the slowest: the node that spent the most time throttled,
    or None when none throttled."""
    if not throttled_s_by_node:
        return None
    name, seconds = max(throttled_s_by_node.items(), key=lambda item: (item[1], item[0]))
    return name if seconds > 0 else None
