"""Metrics read from a job's log: `metrics_from_log`, an RE2 pattern with the named groups
`name` and `value` (and optionally `step`), for scripts that print `val_loss: 0.5` rather
than call MLflow. Matched lines are logged to the job's MLflow run as metrics.

The matching runs where every line of a rank is parsed exactly once: the agent's LogWriter
(agent/output.py, `LogWriter.line`), before the line is stored. Only rank 0's lines are
matched (every rank of a data-parallel job prints the same loss; one series, not N). Each
line is searched once by RE2 (linear in the line, which the agent already caps at
HANGAR_LOG_LINE_MAX_BYTES); a job may create at most MAX_NAMES metric names and log at
most MAX_POINTS points an attempt, so a flood of matches cannot flood MLflow. The points
are sent in batches by the writer's storer thread after each stored batch, never holding
the parser; MLflow being down loses the points, never a line or the job.
"""

import logging
import math
import time
from dataclasses import dataclass

import re2

from portal.patterns import PatternError, compile_user_pattern

log = logging.getLogger("hangar.logmetrics")

FIELD = "metrics_from_log"
EXAMPLE = r"(?P<name>val_loss|val_bpb): (?P<value>[-+0-9.eE]+)"
MAX_NAMES = 100
MAX_POINTS = 100_000
MAX_NAME_CHARS = 250
MLFLOW_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics


def compile_pattern(text: str):
    """The pattern compiled by RE2; PatternError naming the field when it is not one, or lacks the groups."""
    pattern = compile_user_pattern(text, field=FIELD, ignore_case=False)
    missing = [group for group in ("name", "value") if group not in pattern.groupindex]
    if missing:
        groups = " and ".join(f"(?P<{g}>...)" for g in missing)
        raise PatternError(FIELD, f"has no named group {groups}; write it with both, e.g. {EXAMPLE}")
    return pattern


@dataclass(slots=True)
class Point:
    name: str
    value: float
    step: int
    ts_ms: int


class LogMetrics:
    """One rank's matcher: `scan` every line (cheap when nothing matches), `take` the points found."""

    def __init__(self, pattern_text: str):
        self.pattern = compile_pattern(pattern_text)
        self.has_step = "step" in self.pattern.groupindex
        self.steps: dict[str, int] = {}  # per name: the next step when the line gives none
        self.pending: list[Point] = []
        self.found = 0

    def scan(self, text: str) -> None:
        match = self.pattern.search(text)
        if match is None or self.found >= MAX_POINTS:
            return
        point = self.point(match)
        if point is not None:
            self.pending.append(point)
            self.found += 1

    def point(self, match) -> Point | None:
        name = (match.group("name") or "").strip()[:MAX_NAME_CHARS]
        try:
            value = float(match.group("value"))
        except (TypeError, ValueError):
            return None
        if not name or not math.isfinite(value):
            return None
        if name not in self.steps and len(self.steps) >= MAX_NAMES:
            return None
        step = self.steps.get(name, 0)
        if self.has_step and (given := match.group("step")) and given.isdigit():
            step = int(given)
        self.steps[name] = step + 1
        return Point(name, value, step, int(time.time() * 1000))

    def take(self) -> list[Point]:
        points, self.pending = self.pending, []
        return points


def for_job(job, rank: int) -> LogMetrics | None:
    """A matcher for the job's rank, or None: no pattern, another rank, or a pattern this server refuses."""
    if not job.metrics_from_log or rank != 0:
        return None
    try:
        return LogMetrics(job.metrics_from_log)
    except (PatternError, re2.error) as exc:  # checked at submit; a server with other limits may refuse it
        log.warning("job %s: metrics_from_log not used: %s", job.pk, exc)
        return None


def send(run_id: str, points: list[Point]) -> None:
    """Log the points to the run; MLflow failing is logged, never raised (the job runs on)."""
    if not points or not run_id:
        return
    from jobs import tracking

    try:
        c = tracking.client()  # first: it imports MLflow
        from mlflow.entities import Metric

        metrics = [Metric(p.name, p.value, p.ts_ms, p.step) for p in points]
        for start in range(0, len(metrics), MLFLOW_BATCH):
            c.log_batch(run_id, metrics=metrics[start : start + MLFLOW_BATCH])
    except Exception as exc:
        log.warning("run %s: %d metrics from the log not logged: %s", run_id, len(points), exc)
