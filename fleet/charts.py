"""Plotly figures of a node's telemetry, built in Python and shipped as JSON to the bundled plotly.js."""

import json
from datetime import UTC, datetime, timedelta

import plotly.graph_objects as go
from django.db.models import Avg, F, Sum
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


def with_throttle_seconds(node: Node, attempts: list) -> list:
    """Annotate attempts with the seconds their GPUs spent thermal- and power-throttled on this node."""
    now = timezone.now()
    for attempt in attempts:
        attempt.thermal_s = attempt.power_s = 0.0
        if attempt.running_at is None:
            continue
        totals = TelemetrySample.objects.filter(
            node=node,
            gpu_index__in=attempt.gpu_indices,
            at__gte=attempt.running_at,
            at__lte=attempt.finished_at or now,
        ).aggregate(thermal=Sum("thermal_throttle_s"), power=Sum("power_throttle_s"))
        attempt.thermal_s, attempt.power_s = totals["thermal"] or 0.0, totals["power"] or 0.0
    return attempts


def straggler(throttled_s_by_node: dict[str, float]) -> str | None:
    """In a multi-node job every rank waits for the slowest: the node that spent the most time throttled,
    or None when none throttled."""
    if not throttled_s_by_node:
        return None
    name, seconds = max(throttled_s_by_node.items(), key=lambda item: (item[1], item[0]))
    return name if seconds > 0 else None
