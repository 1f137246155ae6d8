"""A job's result in one document, for agents: how it ended and what it scored.

`result(job)` answers `GET /api/v1/jobs/<id>/result/`, `hangar result ID` and each document
of `hangar wait ID... --json`: state, exit code, failure class, the latest attempt's
diagnosis, every metric's last and best value (MLflow), the objective's value, the last 50
log lines and the first error line of the latest attempt, cost, the time spent queued,
in preflight and running over all attempts, and the code it ran. `comparison(a, b)` sets two side by side.

The summaries of metric histories are plain functions over plain data (`summarise`,
`objective_value`); the rest only loads.
"""

import re
from decimal import Decimal

from django.utils import timezone

from jobs import reproduce, tracking
from jobs.api.serializers import JobSerializer, diagnosis_of
from jobs.costs import WASTED_LABELS
from jobs.logquery import first_error, wire_lines
from jobs.models import Attempt, Job, JobState, LogLine, attempt_cost_of

TAIL_LINES = 50
# A metric that is not the objective's is "best" at its minimum, unless its name says higher is better.
HIGHER_IS_BETTER = re.compile(r"acc|f1|auc|precision|recall|bleu|rouge|score|reward|return|map\b|iou", re.IGNORECASE)


# --- plain functions over metric histories ---------------------------------------------


def best_mode(name: str, objective: dict) -> str:
    if objective and objective.get("metric") == name:
        return objective["mode"]
    return "max" if HIGHER_IS_BETTER.search(name) else "min"


def summarise(series: dict, objective: dict) -> dict:
    """{name: {last, best, best_mode, min, max, points}} from {name: [[step, value, ts_ms], ...]} (in step order)."""
    out = {}
    for name, points in series.items():
        if not points:
            continue
        low = min(points, key=lambda p: p[1])
        high = max(points, key=lambda p: p[1])
        mode = best_mode(name, objective)
        out[name] = {
            "last": {"value": points[-1][1], "step": points[-1][0]},
            "best": point(low if mode == "min" else high),
            "best_mode": mode,
            "min": point(low),
            "max": point(high),
            "points": len(points),
        }
    return out


def point(p: list) -> dict:
    return {"value": p[1], "step": p[0]}


def objective_value(objective: dict, summaries: dict) -> dict | None:
    """The objective with its value: the metric's last value (what the run ended at) and its best."""
    if not objective:
        return None
    found = summaries.get(objective["metric"])
    if found is None:
        return {**objective, "value": None, "step": None, "best": None, "best_step": None, "found": False}
    last, best = found["last"], found["best"]
    return {
        **objective,
        "value": last["value"],
        "step": last["step"],
        "best": best["value"],
        "best_step": best["step"],
        "found": True,
    }


# --- loading ------------------------------------------------------------------------------


def result(job: Job) -> dict:
    attempts = list(job.attempts.select_related("node").order_by("number"))
    latest = attempts[-1] if attempts else None
    found = tracking.metrics(job)
    summaries = summarise(found["series"], job.objective)
    return {
        "id": job.pk,
        "name": job.name,
        "project": job.project.slug,
        "state": job.state,
        "final": job.is_final,
        "state_reason": job.state_reason,
        "exit_code": job.exit_code,
        "failure_class": job.failure_class,
        "attempt_count": len(attempts),
        "diagnosis": diagnosis_of(latest),
        "objective": objective_value(job.objective, summaries),
        "metrics": summaries,
        "metrics_available": found["available"],
        "metrics_reason": found["reason"],
        "first_error": first_error_of(job, latest, attempts),
        "log_tail": log_tail(latest),
        "cost": cost_of(attempts),
        "times": times_of(job, attempts),
        "code": JobSerializer().get_code(job),  # the snapshot it ran (hangar submit --code), or null
        "code_version": job.code_version,
        "mlflow_run_id": job.mlflow_run_id,
        "urls": {"api": f"/api/v1/jobs/{job.pk}/", "page": f"/jobs/{job.pk}/", "logs": f"/api/v1/jobs/{job.pk}/logs/"},
    }


def log_tail(latest: Attempt | None, count: int = TAIL_LINES) -> list[dict]:
    if latest is None:
        return []
    lines = list(LogLine.objects.filter(job_id=latest.job_id, attempt_id=latest.pk).order_by("-seq")[:count])
    return [dict(line) for line in wire_lines(lines[::-1])]


def first_error_of(job: Job, latest: Attempt | None, attempts: list[Attempt]) -> dict | None:
    """The latest attempt's first line at ERROR or worse (or naming a fault)."""
    if latest is None:
        return None
    line = first_error(job.pk, skip_attempts=[a.pk for a in attempts if a.pk != latest.pk])
    return dict(wire_lines([line])[0]) if line is not None else None


def cost_of(attempts: list[Attempt]) -> dict:
    """Every attempt's cost (so far, for one still running), at its node's GPU rates."""
    now, total, wasted, preflight, gpu_seconds = timezone.now(), Decimal(0), Decimal(0), Decimal(0), 0.0
    for attempt in attempts:
        cost = attempt_cost_of(attempt, now)
        total += cost.cost
        preflight += cost.preflight_cost
        gpu_seconds += cost.gpu_seconds
        if cost.label in WASTED_LABELS:
            wasted += cost.cost
    return {
        "total": str(total),
        "preflight": str(preflight),
        "wasted": str(wasted),
        "gpu_hours": round(gpu_seconds / 3600, 4),
    }


def times_of(job: Job, attempts: list[Attempt]) -> dict:
    """Seconds queued (each attempt's wait, and the wait now), in preflight and running, over all attempts."""
    now = timezone.now()
    queued = sum(((a.started_at or a.finished_at or now) - a.queued_at).total_seconds() for a in attempts)
    waiting_now = job.state in (JobState.QUEUED, JobState.BLOCKED) and not any(a.finished_at is None for a in attempts)
    if waiting_now:
        queued += (now - job.queued_at).total_seconds()
    return {
        "queued_seconds": round(max(queued, 0.0), 3),
        "preflight_seconds": round(sum(a.preflight_seconds() or 0 for a in attempts), 3),
        "running_seconds": round(sum(a.running_seconds() or 0 for a in attempts), 3),
        "created_at": job.created_at.isoformat(),
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
    }


def comparison(a: Job, b: Job) -> dict:
    """Two jobs side by side: the spec fields that differ, every metric, the objective and the outcome."""
    fields = reproduce.SPEC_FIELDS
    spec = reproduce.diff(reproduce.record(a), reproduce.record(b), fields)
    ra, rb = result(a), result(b)
    names = sorted(set(ra["metrics"]) | set(rb["metrics"]))
    metrics = [
        {
            "metric": name,
            "a": ra["metrics"].get(name),
            "b": rb["metrics"].get(name),
            "best_mode": best_mode(name, a.objective or b.objective),
        }
        for name in names
    ]
    outcome = {k: {"a": ra[k], "b": rb[k]} for k in ("state", "exit_code", "failure_class", "objective")}
    outcome["cost"] = {"a": ra["cost"]["total"], "b": rb["cost"]["total"]}
    return {
        "a": a.pk,
        "b": b.pk,
        "spec_differences": [row for row in spec if row["differs"]],
        "metrics": metrics,
        "outcome": outcome,
        "better": better_of(a.pk, ra["objective"], b.pk, rb["objective"]),
    }


def better_of(a_id: int, a: dict | None, b_id: int, b: dict | None) -> int | None:
    """The job whose objective value is better, when both have one under the same objective."""
    if not a or not b or a.get("value") is None or b.get("value") is None:
        return None
    if (a["metric"], a["mode"]) != (b["metric"], b["mode"]) or a["value"] == b["value"]:
        return None
    lower = a["value"] < b["value"]
    return a_id if lower == (a["mode"] == "min") else b_id
