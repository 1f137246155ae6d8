"""Sweeps: a base job spec and its variants (a `grid:` of values, or a `variants:` list of
overrides), run with at most `max_parallel` unfinished at once, ranked by an objective.

    name: lr
    project: vision
    max_parallel: 4
    objective: {metric: val_loss, mode: min}
    base: {command: [python, train.py], metrics_from_log: "(?P<name>val_loss): (?P<value>\\S+)"}
    grid: {env.LR: ["0.1", "0.01"], gpus_per_node: [1, 2]}      # or
    variants: [{env.LR: "0.1"}, {env: {LR: "0.01"}, max_runtime_seconds: 60}]

An override's key is a job field (`gpus_per_node`) or a dotted path into one (`env.LR`,
`config.lr`). Creating a sweep checks every variant as a job submit would (the same
serializer), then creates the sweep and its first `max_parallel` jobs in one transaction:
any refusal creates nothing. Each variant is a job of its own, submitted through
`submit_job` with its own idempotency key, so the same sweep file sent again returns the
sweep it made and creates nothing twice. When one of its jobs ends, `advance` submits the
next (after commit, under the sweep's row lock).

`expand`, `apply` and `rank` are plain functions over plain data.
"""

import hashlib
import itertools
import json
import logging

from django.db import IntegrityError, transaction
from django.dispatch import receiver
from rest_framework import exceptions
from rest_framework.exceptions import ValidationError

from jobs import results, tokenlimits, tracking
from jobs.models import FINAL_JOB_STATES, Job, Sweep
from jobs.signals import attempt_finished, job_ended
from jobs.submission import IdempotencyConflict, held_by_key, project_for, submit_job

log = logging.getLogger("hangar.sweeps")

FIELDS = ("name", "project", "base", "grid", "variants", "max_parallel", "objective", "idempotency_key")
MAX_VARIANTS = 1000
KEY_TAKEN = "is already used (without one, a sweep's key is a hash of its file); give a new idempotency_key"
STOPPED = "stopped: "  # a refused variant's reason when the whole sweep stopped (`stop`)
DOTTED = ("env", "config")  # fields whose keys an override may set one by one: env.LR, config.lr


# --- plain functions ------------------------------------------------------------------


def expand(body: dict) -> list[dict]:
    """Each variant's overrides: the grid's product (in key order as given), or the variants list."""
    grid, variants = body.get("grid"), body.get("variants")
    if (grid is None) == (variants is None):
        raise ValidationError({"grid": "give either grid (values to combine) or variants (a list of overrides)"})
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            example = '{"env.LR": ["0.1", "0.01"]}'
            raise ValidationError({"grid": f"is empty; give at least one field and its values, e.g. {example}"})
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise ValidationError({f"grid.{key}": "must be a non-empty list of values, e.g. [0.1, 0.01]"})
        combos = list(itertools.islice(itertools.product(*grid.values()), MAX_VARIANTS + 1))
        params = [dict(zip(grid, combo, strict=True)) for combo in combos]
    else:
        if not isinstance(variants, list) or not variants:
            raise ValidationError({"variants": 'is empty; give a list of overrides, e.g. [{"env.LR": "0.1"}]'})
        for index, variant in enumerate(variants):
            if not isinstance(variant, dict):
                raise ValidationError({f"variants[{index}]": "must be a mapping of fields to override"})
        params = list(variants)
    if len(params) > MAX_VARIANTS:
        raise ValidationError({"grid" if grid is not None else "variants": f"makes over {MAX_VARIANTS} variants"})
    return params


def apply(base: dict, overrides: dict) -> dict:
    """The base spec with one variant's overrides (`env.LR: "0.1"` sets one variable)."""
    spec = json.loads(json.dumps(base))  # a deep copy of plain data
    for key, value in overrides.items():
        field, dot, rest = key.partition(".")
        if dot and field in DOTTED:
            spec[field] = {**(spec.get(field) or {}), rest: value}
        elif isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def file_key(body: dict) -> str:
    """The sweep's idempotency key: the one given, else a hash of its canonical content."""
    if given := body.get("idempotency_key"):
        return str(given)[:200]
    return content_hash(body)


def content_hash(body: dict) -> str:
    canonical = json.dumps({k: v for k, v in body.items() if k != "idempotency_key"}, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def rank(runs: list[dict], mode: str) -> list[dict]:
    """Runs best first by objective value; those without one last, by index."""
    scored = [r for r in runs if r["objective"] is not None]
    scored.sort(key=lambda r: r["objective"] if mode == "min" else -r["objective"])
    return scored + sorted((r for r in runs if r["objective"] is None), key=lambda r: r["index"])


# --- creating ---------------------------------------------------------------------------


def check_body(user, body) -> tuple[dict, list[dict], dict]:
    """(base spec with project and objective, each variant's overrides, each variant's checked data)."""
    from jobs.api.serializers import JobSubmitSerializer, ObjectiveSerializer

    if not isinstance(body, dict):
        raise ValidationError({"body": "a sweep is one mapping: name, project, base, grid or variants, objective"})
    if unknown := sorted(set(body) - set(FIELDS)):
        raise ValidationError({name: f"is not a sweep field; sweep fields are {', '.join(FIELDS)}" for name in unknown})
    base = body.get("base")
    if not isinstance(base, dict) or not base.get("command"):
        raise ValidationError({"base": "is required: the job every variant starts from, with its command"})
    if not (wanted := body.get("objective") or base.get("objective")):
        raise ValidationError({"objective": "is required: it ranks the runs, e.g. {metric: val_loss, mode: min}"})
    objective = ObjectiveSerializer(data=wanted)
    if not objective.is_valid():
        raise ValidationError({"objective": objective.errors})
    max_parallel = body.get("max_parallel", 0)
    if not isinstance(max_parallel, int) or isinstance(max_parallel, bool) or not 0 <= max_parallel <= MAX_VARIANTS:
        raise ValidationError(
            {"max_parallel": f"must be a whole number of jobs at once, e.g. 4 (at most {MAX_VARIANTS})"}
        )
    base = {**base, "project": body.get("project") or base.get("project"), "objective": objective.validated_data}
    project_for(user, base["project"] or "")  # the project first: its error says which projects there are
    params = expand(body)
    checked = [checked_variant(user, base, index, p, JobSubmitSerializer) for index, p in enumerate(params)]
    return base, params, checked


def checked_variant(user, base: dict, index: int, overrides: dict, serializer_class) -> dict:
    spec = apply(base, overrides)
    if "idempotency_key" in spec:
        raise ValidationError({f"variants[{index}].idempotency_key": "is the sweep's: each variant gets its own"})
    submit = serializer_class(data=spec)
    if not submit.is_valid():
        where = f"variants[{index}]" if overrides else "base"
        raise ValidationError({where: submit.errors})
    return submit.validated_data


def create(user, body) -> tuple[Sweep, bool]:
    """The sweep `body` describes, and whether it was created now (False: the same file again)."""
    key = file_key(body) if isinstance(body, dict) else ""
    if key and (found := held_sweep(user, key)) is not None:
        if found.content != content_hash(body):
            raise IdempotencyConflict(
                f"idempotency_key {key!r} was used for sweep {found.pk} with another sweep file; "
                "use a new key for a different sweep"
            )
        advance(found.pk)
        return found, False
    base, params, checked = check_body(user, body)
    name = str(body.get("name") or "sweep")[:200]
    try:
        with transaction.atomic():
            sweep = Sweep.objects.create(
                project=project_for(user, base["project"]),
                submitted_by=user,
                submitted_with_id=getattr(user, "api_token_id", None),
                name=name,
                key=key,
                content=content_hash(body),
                base=base,
                params=params,
                max_parallel=body.get("max_parallel") or len(params),
                objective=base["objective"],
            )
            submit_next(sweep, user, checked, strict=True)
    except IntegrityError:  # the same file sent twice at once: the other one made it
        return held_sweep(user, key), False
    return sweep, True


def held_sweep(user, key: str) -> Sweep | None:
    """The caller's sweep of this key, if they may see it now (jobs/submission.py: held_by_key)."""
    mine = Sweep.objects.filter(submitted_by=user, key=key)
    return held_by_key(mine, Sweep.objects.visible_to(user), KEY_TAKEN)


def submit_next(sweep: Sweep, user, checked: list[dict] | None = None, strict: bool = False) -> int:
    """Submit pending variants while fewer than max_parallel are unfinished; the number submitted.
    `strict` (at creation): a refusal is raised, so nothing is created, except a transient one
    (a token's cap, 429) once some variants run. A transient refusal waits for the next of
    its jobs to end (or the file sent again); any other refusal is recorded on the variant."""
    free = sweep.max_parallel - sweep.unfinished().count()
    todo = sweep.pending()[: max(free, 0)]
    # Later (not at creation, whose request was just authenticated): only while its token, its
    # submitter and their membership still hold. Checked before any variant, and by each submit.
    if todo and not strict and (why := tokenlimits.acting_refusal(user, sweep.submitted_with_id, sweep.project)):
        stop(sweep, why)
        return 0
    submitted, waiting, refused = 0, "", dict(sweep.refused)
    for index in todo:
        try:
            submit_variant(sweep, user, index, checked[index] if checked else None)
        except IntegrityError:  # its key is taken: another advance submitted it meanwhile
            continue
        except tokenlimits.TokenEnded as exc:  # revoked since the look above
            if strict:
                raise
            sweep.refused = refused  # the variants refused before it keep their own reasons
            stop(sweep, flat(exc.detail))
            return submitted
        except exceptions.APIException as exc:
            busy = exc.status_code == 429
            if strict and not (busy and submitted):  # at creation: nothing, unless some run and the rest wait
                raise
            if busy:
                waiting = flat(exc.detail)
                break
            refused[str(index)] = flat(exc.detail)
            continue
        submitted += 1
    if (waiting, refused) != (sweep.waiting_reason, sweep.refused):
        sweep.waiting_reason, sweep.refused = waiting, refused
        Sweep.objects.filter(pk=sweep.pk).update(waiting_reason=waiting, refused=refused)
    return submitted


def submit_variant(sweep: Sweep, user, index: int, data: dict | None) -> Job:
    data = data or recheck(sweep, user, index)
    data = {**data, "idempotency_key": f"sweep-{sweep.pk}-{index}", "name": f"{sweep.name}-{index}"}
    with transaction.atomic():
        return submit_job(user, {**data, "sweep": sweep, "sweep_index": index}).job


def recheck(sweep: Sweep, user, index: int) -> dict:
    from jobs.api.serializers import JobSubmitSerializer

    return checked_variant(user, sweep.base, index, sweep.params[index], JobSubmitSerializer)


def flat(detail) -> str:
    from portal.api.shape import flatten

    return "; ".join(f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in flatten(detail))


def advance(sweep_id: int) -> int:
    """Submit what may run now (after one of its jobs ended, or the file was sent again)."""
    with transaction.atomic():
        locked = Sweep.objects.select_for_update(of=("self",)).select_related("submitted_by", "project")
        sweep = locked.filter(pk=sweep_id).first()
        if sweep is None:
            return 0
        return submit_next(sweep, sweep.submitted_by)  # acting for its token (tokenlimits.acting_refusal)


def stop(sweep: Sweep, why: str) -> None:
    """Submit none of its pending variants, saying why on each (its token was revoked, say)."""
    # The same file sent again is a replay of this sweep (its key), which stays stopped.
    why = f"{why}; to run the rest, send the sweep file again with a new idempotency_key"
    refused = {**sweep.refused, **{str(i): STOPPED + why for i in sweep.pending()}}
    Sweep.objects.filter(pk=sweep.pk).update(refused=refused, waiting_reason="")
    sweep.refused, sweep.waiting_reason = refused, ""
    log.info("sweep %s stopped: %s", sweep.pk, why)


def stopped_reason(sweep: Sweep) -> str:
    """Why it stopped submitting variants, or ""."""
    return next((r.removeprefix(STOPPED) for r in sweep.refused.values() if r.startswith(STOPPED)), "")


def cancel(sweep: Sweep, by, reason: str) -> int:
    """Submit no more of its variants and cancel its unfinished jobs; the number of jobs cancelled."""
    with transaction.atomic():
        locked = Sweep.objects.select_for_update().get(pk=sweep.pk)
        refused = {**locked.refused, **{str(i): f"cancelled: {reason}" for i in locked.pending()}}
        Sweep.objects.filter(pk=sweep.pk).update(refused=refused, waiting_reason="")
    return sum(1 for job in sweep.unfinished() if job.cancel(by, reason))


def _advance_after_commit(job_id: int) -> None:
    sweep_id = Job.objects.filter(pk=job_id, state__in=FINAL_JOB_STATES).values_list("sweep_id", flat=True).first()
    if sweep_id:
        _advance_safely(sweep_id)


def _advance_safely(sweep_id: int) -> None:
    try:
        advance(sweep_id)
    except Exception:  # a failed advance must not fail the end of the job that triggered it
        log.exception("sweep %s: the next variants were not submitted", sweep_id)


@receiver(attempt_finished)
def _after_an_attempt(sender, attempt, job, **kwargs) -> None:
    if job.sweep_id and job.is_final:
        transaction.on_commit(lambda: _advance_safely(job.sweep_id))


@receiver(job_ended)
def _after_a_cancel(sender, job, **kwargs) -> None:
    if job.sweep_id:
        transaction.on_commit(lambda: _advance_after_commit(job.pk))


# --- reading ----------------------------------------------------------------------------


def runs(sweep: Sweep) -> list[dict]:
    """Each variant: its params, job, state, objective value (its last) and cost; ranked best first."""
    jobs = {j.sweep_index: j for j in Job.objects.filter(sweep=sweep).prefetch_related("attempts__node")}
    latest = tracking.latest_metrics(list(jobs.values()))  # one MLflow search, not a history per run
    metric = sweep.objective["metric"]
    out = []
    for index, params in enumerate(sweep.params):
        job = jobs.get(index)
        row = {"index": index, "params": params, "job": None, "state": "pending", "objective": None, "cost": None}
        if str(index) in sweep.refused:
            row.update(state="refused", reason=sweep.refused[str(index)])
        if job is not None:
            row.update(job=job.pk, state=job.state, exit_code=job.exit_code,
                       objective=latest.get(job.pk, {}).get(metric),
                       cost=results.cost_of(list(job.attempts.all()))["total"])  # fmt: skip
        out.append(row)
    return rank(out, sweep.objective["mode"])


def document(sweep: Sweep) -> dict:
    ranked = runs(sweep)
    best = next((r for r in ranked if r["objective"] is not None), None)
    counts: dict[str, int] = {}
    for run in ranked:
        counts[run["state"]] = counts.get(run["state"], 0) + 1
    return {
        "id": sweep.pk,
        "name": sweep.name,
        "project": sweep.project.slug,
        "state": "running" if any(r["state"] not in (*FINAL_JOB_STATES, "refused") for r in ranked) else "done",
        "objective": sweep.objective,
        "max_parallel": sweep.max_parallel,
        "variants": sweep.size,
        "counts": counts,
        "waiting_reason": sweep.waiting_reason,
        "stopped_reason": stopped_reason(sweep),
        "best": best,
        "runs": ranked,
        "base": sweep.base,
        "created_at": sweep.created_at.isoformat(),
        "urls": {"api": f"/api/v1/sweeps/{sweep.pk}/", "page": f"/jobs/sweeps/{sweep.pk}/"},
    }


def figures(sweep: Sweep, ranked: list[dict]) -> dict:
    """The sweep page's charts: the objective per run, and parameters -> objective (parallel coordinates)."""
    import plotly.graph_objects as go

    metric = sweep.objective["metric"]
    scored = sorted((r for r in ranked if r["objective"] is not None), key=lambda r: r["index"])
    per_run = go.Figure(go.Bar(x=[f"#{r['index']}" for r in scored], y=[r["objective"] for r in scored]))
    per_run.update_layout(yaxis_title=metric, xaxis_title="variant", margin={"l": 60, "r": 10, "t": 20, "b": 40})
    dimensions = [dimension(name, [r["params"].get(name) for r in scored]) for name in param_names(sweep)]
    dimensions.append({"label": metric, "values": [r["objective"] for r in scored]})
    line = {"color": [r["objective"] for r in scored], "colorscale": "Viridis", "showscale": True}
    parallel = go.Figure(go.Parcoords(line=line, dimensions=dimensions))
    parallel.update_layout(margin={"l": 60, "r": 60, "t": 40, "b": 20})
    return {"per_run": json.loads(per_run.to_json()), "parallel": json.loads(parallel.to_json())}


def param_names(sweep: Sweep) -> list[str]:
    names: list[str] = []
    for params in sweep.params:
        names += [k for k in params if k not in names]
    return names


def dimension(name: str, values: list) -> dict:
    """A parallel-coordinates axis: numbers as they are, anything else as categories."""
    try:
        return {"label": name, "values": [float(v) for v in values]}
    except (TypeError, ValueError):
        labels = sorted({json.dumps(v, sort_keys=True) if not isinstance(v, str) else v for v in values})
        codes = {label: i for i, label in enumerate(labels)}
        shown = [json.dumps(v, sort_keys=True) if not isinstance(v, str) else v for v in values]
        values = [codes[v] for v in shown]
        return {"label": name, "values": values, "tickvals": list(codes.values()), "ticktext": labels}
