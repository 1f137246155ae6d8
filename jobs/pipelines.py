"""Pipelines: named stages, each a job spec, with `needs:` between them (a DAG), shared
parameters and one shared directory per run.

    name: tiny
    project: vision
    params: {EPOCHS: "3"}          # env of every stage; ${params.EPOCHS} in a command
    defaults: {environment: cuda}  # job fields every stage starts from
    stages:
      prepare: {command: [python, prep.py]}
      train: {needs: [prepare], command: [python, train.py, --epochs, "${params.EPOCHS}"]}
      evaluate: {needs: [train], command: [python, eval.py]}

`plan` checks the document's shape as a pure function (names, needs, cycles, params). A
run's stages are then checked as job specs (JobSubmitSerializer, all of them first) and
created in one transaction through `submit_job`, in topological order, each with
`depends_on` on the jobs of the stages it needs: the blocked state and the cancel of a
stage whose need failed are jobs/dependencies.py's. Any refusal rolls everything back, and
its field names the stage: `stages.train.gpus_per_node`.

Every attempt of a stage gets HANGAR_PIPELINE_DIR, the run's directory under
HANGAR_PIPELINE_ROOT (a shared filesystem when stages run on several nodes). Run again
from a stage reruns it and every stage downstream of it; the others are reused (their
jobs, not run again), and the new run's directory starts as a copy of the earlier one's, made
on the node by its first stage's attempt, as that stage's uid (agent/pipelinecopy.py): the web
process never reads a directory a job wrote. A run is run again only once every stage ended.
"""

import graphlib
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.dispatch import receiver
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.status import HTTP_409_CONFLICT

from jobs import jobspec, reproduce
from jobs.models import Job, JobState, PipelineRun, PipelineStage, pipeline_state
from jobs.models.pipeline import CopyState
from jobs.signals import attempt_finished, job_ended
from jobs.submission import project_for, submit_job
from portal import statements
from portal.models import Project, Role

STAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
PARAM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PARAM_REF = re.compile(r"\$\{params\.([^}]*)\}")
FIELDS = ("name", "project", "params", "defaults", "stages", "idempotency_key")
NOT_A_STAGE_FIELD = {
    "project": "is the pipeline's: give project once, at the top of the file",
    "depends_on": "is set from needs: list the stages this one waits for, e.g. needs: [prepare]",
    "idempotency_key": "is the pipeline's: give idempotency_key once, at the top of the file",
}
MAX_STAGES = 100
SECRET_MASK = "********"


@dataclass
class Stage:
    name: str
    needs: list[str]
    spec: dict  # job fields, params substituted, before the job spec's own checks


@dataclass
class Plan:
    name: str
    project: str
    params: dict[str, str]
    stages: list[Stage]  # in a topological order: every stage after the ones it needs
    idempotency_key: str = ""


class RunNotOver(APIException):
    """A rerun asked of a run with a stage not yet ended: its directory may still change."""

    status_code = HTTP_409_CONFLICT
    default_code = "pipeline_running"


@dataclass
class Submitted:
    run: PipelineRun
    warnings: list[str] = field(default_factory=list)


def refuse(errors: dict[str, str]) -> None:
    if errors:
        raise ValidationError({key: [message] for key, message in errors.items()})


def plan(document) -> Plan:
    """The document's shape, checked: every problem it finds, each under the field it is about."""
    if not isinstance(document, dict):
        raise ValidationError({"stages": ["the pipeline must be an object with project and stages"]})
    known = ", ".join(FIELDS)
    errors = {key: f"is not a pipeline field; known fields are {known}" for key in document if key not in FIELDS}
    project, name = document.get("project"), document.get("name", "pipeline")
    if not isinstance(project, str) or not project:
        errors["project"] = "is required: give the slug of a project you are a member of"
    if not isinstance(name, str) or not 0 < len(name) <= 100:
        errors["name"] = "must be a string of 1 to 100 characters"
    params = checked_params(document.get("params", {}), errors)
    defaults = document.get("defaults", {})
    if not isinstance(defaults, dict):
        errors["defaults"] = "must be an object of job fields every stage starts from, e.g. {environment: cuda}"
        defaults = {}
    stages = checked_stages(document.get("stages"), defaults, params, errors)
    key = document.get("idempotency_key", "")
    if not isinstance(key, str) or len(key) > 200:
        errors["idempotency_key"] = "must be a string of at most 200 characters"
    refuse(errors)
    return Plan(name, project, params, in_order(stages), key)


def checked_params(params, errors: dict) -> dict[str, str]:
    if not isinstance(params, dict):
        errors["params"] = 'must be an object of NAME: value pairs, e.g. {EPOCHS: "3"}'
        return {}
    out = {}
    for name, value in params.items():
        where = f"params.{name}"
        if not PARAM_NAME.match(str(name)):
            errors[where] = "is not a valid name; use letters, digits and '_', not starting with a digit"
        elif problem := jobspec.env_problem([name]):
            errors[where] = problem.replace("from env", "from params")
        elif isinstance(value, bool) or not isinstance(value, (str, int, float)):
            errors[where] = "must be a string or a number (it is given to every stage as an environment variable)"
        else:
            out[name] = str(value)
    return out


def checked_stages(stages, defaults: dict, params: dict, errors: dict) -> dict[str, Stage]:
    if not isinstance(stages, dict) or not stages:
        errors["stages"] = "is required: an object of stage names, each a job spec, e.g. {train: {command: [...]}}"
        return {}
    if len(stages) > MAX_STAGES:
        errors["stages"] = f"has {len(stages)} stages; a pipeline has at most {MAX_STAGES}"
        return {}
    out = {}
    for name, body in stages.items():
        where = f"stages.{name}"
        if not isinstance(name, str) or not STAGE_NAME.match(name):
            errors[where] = "is not a stage name; use lower-case letters, digits, '-' and '_' (at most 64)"
        elif not isinstance(body, dict):
            errors[where] = "must be an object of job fields, e.g. {command: [python, train.py]}"
        else:
            out[name] = stage_of(name, body, defaults, params, errors)
    for stage in out.values():
        for need in stage.needs:
            if need not in stages:
                errors[f"stages.{stage.name}.needs"] = f"{need!r} is not a stage; stages are {', '.join(out)}"
            elif need == stage.name:
                errors[f"stages.{stage.name}.needs"] = "a stage cannot need itself"
    return out


def stage_of(name: str, body: dict, defaults: dict, params: dict, errors: dict) -> Stage:
    where = f"stages.{name}"
    for key, why in NOT_A_STAGE_FIELD.items():
        if key in body or key in defaults:
            errors[f"{where}.{key}"] = why
    needs = body.get("needs", [])
    if isinstance(needs, str):
        needs = [needs]
    if not isinstance(needs, list) or not all(isinstance(n, str) for n in needs):
        errors[f"{where}.needs"] = "must be a list of stage names, e.g. [prepare]"
        needs = []
    spec = {**defaults, **{k: v for k, v in body.items() if k != "needs" and k not in NOT_A_STAGE_FIELD}}
    envs = [defaults.get("env") or {}, body.get("env") or {}]
    bad = next((env for env in envs if not isinstance(env, dict)), None)
    spec["env"] = bad if bad is not None else {**params, **envs[0], **envs[1]}  # a bad env: the spec's check says so
    spec["name"] = body.get("name") or name  # the job's name: the stage's, unless it gives one
    if isinstance(spec.get("command"), list):
        command = enumerate(spec["command"])
        spec["command"] = [substituted(arg, params, f"{where}.command[{i}]", errors) for i, arg in command]
    return Stage(name, list(dict.fromkeys(needs)), spec)


def substituted(arg, params: dict, where: str, errors: dict):
    """`${params.NAME}` in an argument, replaced by the parameter's value (no shell: text only)."""
    if not isinstance(arg, str):
        return arg  # the job spec's check says what is wrong with it

    def value(match: re.Match) -> str:
        if match.group(1) not in params:
            known = ", ".join(params) or "none"
            errors[where] = f"${{params.{match.group(1)}}} is not a parameter; params: {known}"
            return match.group(0)
        return params[match.group(1)]

    return PARAM_REF.sub(value, arg)


def in_order(stages: dict[str, Stage]) -> list[Stage]:
    sorter = graphlib.TopologicalSorter({s.name: [n for n in s.needs if n in stages] for s in stages.values()})
    try:
        order = list(sorter.static_order())
    except graphlib.CycleError as exc:
        cycle = exc.args[1]
        message = f"a cycle: {' -> '.join(cycle)}; a stage cannot wait for itself, remove one of these needs"
        raise ValidationError({f"stages.{cycle[0]}.needs": [message]})
    return [stages[name] for name in order]


def downstream(stages: list[Stage] | list[PipelineStage], start: str) -> set[str]:
    """`start` and every stage that needs it, directly or not."""
    found = {start}
    for stage in stages:  # topological order: a stage comes after the ones it needs
        if set(stage.needs) & found:
            found.add(stage.name)
    return found


def checked_spec(stage: str, spec: dict) -> dict:
    """A stage's spec as JobSubmitSerializer checks a job's; its errors named `stages.<stage>.<field>`."""
    from jobs.api.serializers import JobSubmitSerializer

    checking = JobSubmitSerializer(data=spec)
    if not checking.is_valid():
        raise ValidationError({"stages": {stage: checking.errors}})
    return dict(checking.validated_data)


def submit_stage(user, stage: str, spec: dict, needs: dict[str, Job], copy_of: Job | None = None):
    depends_on = [{"job": job.pk, "on": "succeeded"} for job in needs.values()]
    try:
        return submit_job(user, {**spec, "depends_on": depends_on}, copy_of)
    except ValidationError as exc:
        raise ValidationError({"stages": {stage: exc.detail}})


def submit_pipeline(user, document) -> Submitted:
    """Check the whole pipeline, then create its run and every stage's job, or nothing."""
    planned = plan(document)
    project = project_for(user, planned.project)
    specs, errors = {}, {}
    for stage in planned.stages:
        try:
            specs[stage.name] = checked_spec(stage.name, {**stage.spec, "project": planned.project})
        except ValidationError as exc:
            errors.update(exc.detail["stages"])
    if errors:
        raise ValidationError({"stages": errors})
    with transaction.atomic():
        run = PipelineRun.objects.create(
            project=project, submitted_by=user, name=planned.name, params=planned.params,
            document=without_secrets(document), idempotency_key=planned.idempotency_key,
        )  # fmt: skip
        warnings = create_stages(run, user, [(s.name, s.needs, specs[s.name], None) for s in planned.stages])
        make_directory(run)
    return Submitted(run, warnings)


def create_stages(run: PipelineRun, user, stages: list[tuple]) -> list[str]:
    """(name, needs, spec or a reused Job, copy_of) in order: each stage's job, then its row."""
    jobs: dict[str, Job] = {}
    warnings: list[str] = []
    for position, (name, needs, spec, copy_of) in enumerate(stages):
        if isinstance(spec, Job):
            jobs[name] = spec
        else:
            submitted = submit_stage(user, name, spec, {n: jobs[n] for n in needs}, copy_of)
            jobs[name] = submitted.job
            warnings += [w for w in submitted.warnings if w not in warnings]
        PipelineStage.objects.create(
            run=run, name=name, needs=needs, position=position, job=jobs[name], reused=isinstance(spec, Job)
        )
    return warnings


def masked(fields):
    if isinstance(fields, dict) and isinstance(fields.get("secret_env"), dict):
        return {**fields, "secret_env": dict.fromkeys(fields["secret_env"], SECRET_MASK)}
    return fields


def without_secrets(document: dict) -> dict:
    """The document as kept on the run: secret values replaced by a mask (the jobs keep them, encrypted)."""
    kept = {**document}
    if "defaults" in document:
        kept["defaults"] = masked(document["defaults"])
    if isinstance(document.get("stages"), dict):
        kept["stages"] = {name: masked(body) for name, body in document["stages"].items()}
    return kept


def make_directory(run: PipelineRun, copy_from: PipelineRun | None = None) -> None:
    """The run's directory: a name no other job can guess. A fresh run's is made empty here,
    before the transaction commits (no stage starts before that). A rerun's is not made here:
    its first stage's attempt copies the earlier run's on its node, as that stage's uid, and
    the run shows how far that got (agent/pipelinecopy.py)."""
    path = Path(settings.HANGAR_PIPELINE_ROOT) / f"{run.pk}-{secrets.token_hex(8)}"
    run.directory = str(path)
    if copy_from is not None:
        run.copy_state = CopyState.WAITING
        run.save(update_fields=["directory", "copy_state"])
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir()
    run.save(update_fields=["directory"])


def refuse_while_running(earlier: PipelineRun, stages: list[PipelineStage]) -> None:
    """A run is run again once every stage of it ended: a stage still going could change the
    directory the rerun starts from while it is copied."""
    going = next((stage for stage in stages if not stage.job.is_final), None)
    if going is not None:
        message = (
            f"stage {going.name} (job {going.job_id}) is {going.job.state}: pipeline run {earlier.pk} has not "
            f"ended, and a rerun starts from its directory as every stage left it. Wait for the run to end, or "
            f"cancel it (hangar pipeline cancel {earlier.pk}), then run it again"
        )
        raise RunNotOver({"stages": {going.name: [message]}})


def rerun(user, earlier: PipelineRun, from_stage: str = "", given_secrets=None) -> Submitted:
    """Run `earlier` again, once every stage of it ended: every stage, or `from_stage` and what
    is downstream of it (the other stages are reused, and the new directory starts as a copy of
    the earlier one, made by the first stage's attempt: make_directory)."""
    stages = earlier.ordered_stages()
    names = [s.name for s in stages]
    if from_stage and from_stage not in names:
        message = f"{from_stage!r} is not a stage of pipeline run {earlier.pk}; stages are {', '.join(names)}"
        raise ValidationError({"from_stage": [message]})
    refuse_while_running(earlier, stages)
    again = downstream(stages, from_stage) if from_stage else set(names)
    for stage in stages:
        for need in stage.needs if stage.name in again else []:
            used = next(s for s in stages if s.name == need)
            if need not in again and used.job.state != JobState.SUCCEEDED:
                raise ValidationError(
                    {"from_stage": [f"stage {need} (job {used.job_id}) {used.job.state} in pipeline run {earlier.pk}, "
                                    f"so its output cannot be reused; run again from {need}"]}
                )  # fmt: skip
    project_for(user, earlier.project.slug)
    specs = {}
    for stage in stages:
        if stage.name in again:
            data = jobspec.copy_for(stage.job, reproduce.clone_data(stage.job), user, given_secrets)
            specs[stage.name] = checked_spec(stage.name, data)
    with transaction.atomic():
        run = PipelineRun.objects.create(
            project=earlier.project, submitted_by=user, name=earlier.name, params=earlier.params,
            document=earlier.document, rerun_of=earlier, from_stage=from_stage,
        )  # fmt: skip
        plan_rows = [(s.name, s.needs, specs.get(s.name, s.job), s.job if s.name in again else None) for s in stages]
        warnings = create_stages(run, user, plan_rows)
        make_directory(run, earlier if from_stage else None)
    return Submitted(run, warnings)


def can_manage(user, run: PipelineRun) -> bool:
    """Its submitter while a member of its project, and the project's managers (as for a job)."""
    managed = Project.objects.with_role(user, Role.MANAGER).filter(pk=run.project_id).exists()
    member = Project.objects.with_role(user, Role.MEMBER).filter(pk=run.project_id).exists()
    return managed or (member and run.submitted_by_id == user.pk)


def cancel(run: PipelineRun, by, reason: str = "") -> list[str]:
    """Cancel every stage of the run still waiting or running (not the reused ones): the
    blocked ones first, so each says why in its own words; the names of those cancelled."""
    reason = reason or f"pipeline run {run.pk} cancelled by {by}"
    cancelled = []
    for stage in reversed(run.ordered_stages()):
        if not stage.reused and not stage.job.is_final and stage.job.cancel(by, reason):
            cancelled.append(stage.name)
    return cancelled[::-1]


@statements.query
def stage_job_runs(job_id: int):
    """The stage a job runs, with its run (one at most: no ordering, through the run, to build)."""
    return PipelineStage.objects.filter(job_id=job_id, reused=False).select_related("run").order_by()[:1]


def stage_run_by(job: Job) -> PipelineStage | None:
    """The stage this job runs (with its run), or None. Read once per job object: an attempt's
    start asks several times (its env, its directory, the sandbox's binds, its MLflow run's tags)."""
    if not hasattr(job, "_pipeline_stage"):
        job._pipeline_stage = stage_job_runs.first(job_id=job.pk)
    return job._pipeline_stage


def runs_no_stage(job: Job) -> None:
    """The caller read, with the job, that it runs no stage: stage_run_by reads nothing for it."""
    job._pipeline_stage = None


def stage_env(job: Job) -> dict[str, str]:
    """What every attempt of a stage is given: HANGAR_PIPELINE_DIR, the run and the stage ({} for other jobs)."""
    if (stage := stage_run_by(job)) is None:
        return {}
    return {
        "HANGAR_PIPELINE_DIR": stage.run.directory,
        "HANGAR_PIPELINE_RUN": str(stage.run_id),
        "HANGAR_PIPELINE_STAGE": stage.name,
    }


def record(job: Job) -> dict | None:
    """The job's place in a pipeline for its Reproduce record: the run, the stage, and the
    jobs of the stages it needed (upstream)."""
    stage = PipelineStage.objects.filter(job=job, reused=False).select_related("run").first()
    if stage is None:
        return None
    upstream = stage.run.stages.filter(name__in=stage.needs).order_by("position").values_list("name", "job_id")
    return {
        "run": stage.run_id,
        "name": stage.run.name,
        "stage": stage.name,
        "upstream": [{"stage": name, "job": job_id} for name, job_id in upstream],
        "directory": stage.run.directory,
        "rerun_of": stage.run.rerun_of_id,
    }


def run_over(job_id: int) -> None:
    """A stage's job ended: close the parent MLflow run of every run it belongs to that is now over."""
    from jobs import tracking

    for run in PipelineRun.objects.filter(stages__job_id=job_id, stages__reused=False).exclude(mlflow_run_id=""):
        state = pipeline_state(list(run.stages.values_list("job__state", flat=True)))
        if state != "running":
            tracking.close_parent_run(run, state)


STOPPED = "stopped: "  # a stage's reason when jobs/dependencies.py settle stopped it: what it acted for ended


def stopped_reason(job_reasons: list[str]) -> str:
    """Why a run stopped starting its stages (from its stages' jobs' reasons), or ""."""
    return next((r.removeprefix(STOPPED) for r in job_reasons if r.startswith(STOPPED)), "")


@receiver(attempt_finished)
def _after_an_attempt(sender, attempt, job, **kwargs) -> None:
    if job.staged:
        transaction.on_commit(lambda: run_over(job.pk))


@receiver(job_ended)
def _after_a_cancel(sender, job, **kwargs) -> None:
    job_id = job.pk
    transaction.on_commit(lambda: run_over(job_id))
