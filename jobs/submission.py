"""Submitting a job: the one place a job is created.

`submit_job(user, spec)` takes a request whose shape is already checked (the API's
JobSubmitSerializer: types, ranges, argv, variable names) and decides whether this
user may run it here: the project and the user's role in it, the environment, whether
any node is large enough, the volumes and the modes the role grants, the priority class
and who may use it, the code snapshot it names (the project's own), the project's per-job
GPU limit and its budget. Then it creates the job and its first event, and wakes the
scheduler after commit. The API, the HTML form, resubmit and run-again all come through
here, so all refuse the same things the same way: a ValidationError whose keys name the
field and whose message says what to change.
"""

from dataclasses import dataclass, field

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet
from rest_framework import status
from rest_framework.exceptions import APIException, ValidationError

from jobs import dependencies, jobspec, snapshots, tokenlimits
from jobs.api.capacity import node_sizes
from jobs.api.costs import check_budget
from jobs.models import Environment, Job, JobEvent, JobState, priority_class, priority_classes
from jobs.models.environment import requirements_key, requirements_of
from portal import wakeup
from portal.models import Project, Role, VolumeMode, project_with_role


class IdempotencyConflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "idempotency_conflict"


KEY_TAKEN = "is already used; use a new key"


def held_by_key(mine: QuerySet, visible: QuerySet, taken: str = KEY_TAKEN):
    """What a replayed idempotency key holds for the caller (`mine`: the caller's own job, run or
    sweep with that key), or None when the key is free. One in a project the caller may not see
    now (a project they left, or outside their token's project) answers 409 naming nothing: a
    replay would hand it back whole, and a mismatch's message says which of its fields differ."""
    held = mine.first()
    if held is None:
        return None
    if not visible.filter(pk=held.pk).exists():
        raise IdempotencyConflict({"idempotency_key": taken})
    return held


@dataclass
class Submitted:
    job: Job
    warnings: list[str] = field(default_factory=list)


def submit_job(user, spec: dict, copy_of: Job | None = None) -> Submitted:
    """Check `spec` (JobSubmitSerializer's validated data) for `user`, then create the job.
    `copy_of`: the job a resubmit or run-again copies (its secrets are not another user's to reuse)."""
    project = project_for(user, spec["project"])
    checked = {
        **spec,
        "project": project,
        "environment": environment_named(spec.get("environment") or ""),
        "volumes": granted_volumes(user, project, spec.get("volumes") or []),
        "priority": checked_priority(user, project, spec.get("priority") or ""),
        "depends_on": checked_dependencies(user, project, spec.get("depends_on") or []),
    }
    checked["snapshot"], checked["code"], checked["code_diff"] = snapshots.for_submit(project, spec.get("code"))
    check_capacity(spec["gpus_per_node"], spec["nodes"], spec.get("gpu_type", ""))
    jobspec.check(checked, user, copy_of)  # container PATH and image, volume paths, network, copied secrets
    check_gpu_limit(project, spec["gpus_per_node"] * spec["nodes"])
    warnings = [w for w in [check_budget(project)] if w]
    checked["submitted_with"] = getattr(user, "api_token_id", None)  # its limits count the job (jobs/tokenlimits.py)
    return Submitted(create(user, checked), warnings)


def project_for(user, slug: str) -> Project:
    project = project_with_role(user, slug, Role.MEMBER)
    if project is None:
        mine = ", ".join(Project.objects.with_role(user, Role.MEMBER).values_list("slug", flat=True)) or "none"
        raise ValidationError({"project": f"no project {slug!r} that you can submit to; your projects: {mine}"})
    return project


def environment_named(name: str) -> Environment | None:
    if not name:
        return None
    environment = Environment.objects.filter(name=name).first()
    if environment is None:
        known = ", ".join(Environment.objects.values_list("name", flat=True)) or "none"
        raise ValidationError({"environment": f"no environment {name!r}; environments: {known}"})
    return environment


def checked_priority(user, project: Project, name: str) -> str:
    """The project's default class, or the one asked for if this user may use it."""
    classes = priority_classes()
    name = name or project.default_priority
    if name not in classes:
        raise ValidationError({"priority": f"{name} is not a priority class; use one of {', '.join(classes)}"})
    ceiling = priority_class(project.max_member_priority)
    manager = Project.objects.with_role(user, Role.MANAGER).filter(pk=project.pk).exists
    if classes[name].rank > ceiling.rank and not manager():
        allowed = ", ".join(n for n, c in classes.items() if c.rank <= ceiling.rank)
        raise ValidationError({"priority": f"{name} needs a manager of {project.slug}; members may use {allowed}"})
    return name


def granted_volumes(user, project: Project, wanted: list[dict]) -> list[dict]:
    """Each volume must exist in the project and the user's role must grant its mode."""
    if not wanted:
        return []
    role = Project.objects.role_of(user, project)
    known = {v.name: v for v in project.volumes.all()}
    granted = []
    for index, request in enumerate(wanted):
        volume = known.get(request["name"])
        name_field = f"volumes[{index}].name"
        if volume is None:
            names = ", ".join(known) or "none registered"
            raise ValidationError(
                {name_field: f"project {project} has no volume {request['name']!r}; its volumes: {names}"}
            )
        if not volume.allows(role, request["mode"]):
            writing = request["mode"] == VolumeMode.READ_WRITE
            needed = volume.write_role if writing else volume.read_role
            fix = "; ask for mode ro" if writing else "; ask a project admin for a higher role"
            message = f"mounting {volume.name} {request['mode']} needs the {needed} role in {project}; you are {role}"
            raise ValidationError({name_field: message + fix})
        granted.append({"name": volume.name, "path": volume.path, "mode": request["mode"], "version": volume.version})
    return granted


def checked_dependencies(user, project: Project, wanted: list[dict]) -> list[dict]:
    """Each job depended on must be one the user sees in this project, and able to end as asked.
    (It exists already, so no cycle can form.)"""
    if not wanted:  # most jobs: building the read of visible jobs was ~15 % of a submit's CPU
        return []
    visible = Job.objects.visible_to(user).select_related("project")
    found = {j.pk: j for j in visible.filter(pk__in=[d["job"] for d in wanted])}
    deps: dict[int, dict] = {}
    for index, dep in enumerate(wanted):
        field, other = f"depends_on[{index}].job", found.get(dep["job"])
        if other is None:
            raise ValidationError({field: f"no job {dep['job']} that you can see; give the id of a job of {project}"})
        if other.project_id != project.pk:
            raise ValidationError(
                {field: f"job {other.pk} is in project {other.project.slug}; depend only on jobs of {project.slug}"}
            )
        if dep["on"] == "succeeded" and other.is_final and other.state != JobState.SUCCEEDED:
            raise ValidationError(
                {field: f"job {other.pk} {other.state}, so it will never succeed; use on=finished or resubmit it"}
            )
        strongest = "succeeded" if "succeeded" in (dep["on"], deps.get(other.pk, {}).get("on")) else "finished"
        deps[other.pk] = {"job": other.pk, "on": strongest}
    return list(deps.values())


def check_capacity(gpus: int, nodes: int, gpu_type: str) -> None:
    """Refuse what no set of registered nodes could ever run."""
    every = node_sizes()
    sizes = [count for model, count in every if not gpu_type or model == gpu_type]
    largest, big_enough = max(sizes, default=0), sum(1 for count in sizes if count >= gpus)
    if gpu_type and not largest:
        types = ", ".join(sorted({model for model, _ in every})) or "none registered"
        raise ValidationError({"gpu_type": f"no node has {gpu_type} GPUs; GPU types: {types}"})
    if gpus > largest:
        where = f"the largest {gpu_type} node" if gpu_type else "the largest node"
        raise ValidationError(
            {"gpus_per_node": f"gpus_per_node={gpus} but {where} has {largest}; ask for at most {largest}"}
        )
    if nodes > big_enough:
        kind = f"{gpu_type} " if gpu_type else ""
        raise ValidationError(
            {"nodes": f"nodes={nodes} but only {big_enough} {kind}nodes have {gpus} GPUs; ask for fewer"}
        )


def check_gpu_limit(project: Project, total: int) -> None:
    limit = project.max_gpus_per_job
    if limit is not None and total > limit:
        raise ValidationError(
            {"gpus_per_node": f"asks for {total} GPUs; project {project.slug} allows at most {limit} a job"}
        )


def create(user, checked: dict) -> Job:
    command = checked["command"]
    wanted = checked["environment"], checked.get("requirements") or [], checked.get("python_version") or ""
    waits = dependencies.standing(checked["depends_on"]) if checked["depends_on"] else None
    with transaction.atomic():
        tokenlimits.check(checked.get("submitted_with"), checked["gpus_per_node"] * checked["nodes"])
        job = Job.objects.create(
            depends_on=checked["depends_on"],
            state=JobState.BLOCKED if waits and waits.kind != "met" else JobState.QUEUED,
            state_reason=waits.reason if waits and waits.kind != "met" else "",
            project=checked["project"],
            submitted_by=user,
            name=checked.get("name") or command[0].rsplit("/", 1)[-1],
            command=command,
            env=checked.get("env", {}),
            secret_env=checked.get("secret_env", {}),
            volumes=checked["volumes"],
            idempotency_key=checked.get("idempotency_key", ""),
            gpus_per_node=checked["gpus_per_node"],
            nodes=checked["nodes"],
            gpu_type=checked.get("gpu_type", ""),
            priority=checked["priority"],
            preemptible=checked.get("preemptible"),
            max_retries=checked["max_retries"],
            stop_on_hang=checked.get("stop_on_hang", False),
            environment=checked["environment"],
            requirements=checked.get("requirements") or [],
            python_version=checked.get("python_version") or "",
            launcher=checked.get("launcher") or "",
            requirements_key=requirements_key(*requirements_of(*wanted)),
            max_runtime_seconds=checked.get("max_runtime_seconds") or settings.HANGAR_DEFAULT_MAX_RUNTIME_SECONDS,
            code_version=checked.get("code_version") or snapshots.version_of(checked["code"]),
            snapshot=checked["snapshot"],
            code=checked["code"],
            code_diff=checked["code_diff"],
            config=checked.get("config") or {},
            data_refs=checked.get("data_refs", []),
            objective=dict(checked.get("objective") or {}),
            metrics_from_log=checked.get("metrics_from_log", ""),
            submitted_with_id=checked.get("submitted_with"),
            sweep=checked.get("sweep"),  # a sweep's variant (jobs/sweeps.py)
            sweep_index=checked.get("sweep_index"),
        )
        JobEvent.insert_rows([(job.pk, None, job.created_at, "submitted", f"by {job.submitted_by}")])
        if job.snapshot is not None:
            job.snapshot.touch()  # retention counts from the last job that named it
        if job.state == JobState.BLOCKED:
            # A job it depends on may end between the look above and this commit: look again after.
            transaction.on_commit(lambda: dependencies.settle(job))
        else:
            wakeup.request_pass()
    return job
