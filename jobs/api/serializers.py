import copy
import re

from django.conf import settings
from django.db import transaction
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from jobs.api.capacity import node_sizes
from jobs.api.costs import check_budget
from jobs.models import Attempt, Environment, Job, JobEvent, priority_class, priority_classes
from jobs.scheduler import request_pass
from portal.models import Project, Role, VolumeMode

SECRET_MASK = "********"
DATETIME = serializers.DateTimeField()  # formats as the API's datetimes do (ISO 8601, Z for UTC)

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_ENV = ("CUDA_VISIBLE_DEVICES",)
RESERVED_ENV_PREFIX = "HANGAR_"
ARGV_EXAMPLE = '["python", "train.py", "--epochs", "3"]'


class ArgvField(serializers.ListField):
    """A command as an argv list. A string is refused: the API never splits or shells it."""

    def __init__(self, **kwargs):
        super().__init__(child=serializers.CharField(allow_blank=True, trim_whitespace=False), **kwargs)

    def to_internal_value(self, data):
        if isinstance(data, str):
            self.fail("not_a_list", input_type="string")
        argv = super().to_internal_value(data)
        if not argv or not argv[0].strip():
            self.fail("empty")
        return argv


def check_env_names(env: dict) -> dict:
    for key in env:
        if not ENV_NAME.match(key):
            raise serializers.ValidationError(
                f"{key!r} is not a valid variable name; use letters, digits and '_', not starting with a digit"
            )
        if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIX):
            raise serializers.ValidationError(f"{key} is set by Hangar for each attempt; remove it from env")
    return env


class VolumeRequestSerializer(serializers.Serializer):
    name = serializers.SlugField(max_length=64)
    mode = serializers.ChoiceField(
        choices=VolumeMode.choices,
        default=VolumeMode.READ,
        error_messages={"invalid_choice": "{input} is not a volume mode; use ro (read-only) or rw (read-write)"},
    )


class JobSubmitSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    project = serializers.SlugField(
        error_messages={"required": "is required: give the slug of a project you are a member of"}
    )
    command = ArgvField(
        error_messages={
            "required": f"is required: give the program and its arguments as a list, e.g. {ARGV_EXAMPLE}",
            "empty": f"must not be empty: give the program and its arguments as a list, e.g. {ARGV_EXAMPLE}",
            "not_a_list": f"must be a list of strings (argv), not a {{input_type}}; e.g. {ARGV_EXAMPLE}. "
            "Hangar never runs a command through a shell",
        }
    )
    env = serializers.DictField(child=serializers.CharField(allow_blank=True, trim_whitespace=False), required=False)
    secret_env = serializers.DictField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False),
        required=False,
        help_text="Variables given to the job but never shown back (masked in pages, API and audit).",
    )
    volumes = VolumeRequestSerializer(many=True, required=False)
    idempotency_key = serializers.CharField(
        max_length=200,
        required=False,
        allow_blank=True,
        help_text="Or the Idempotency-Key header: a retried submit with the same key returns the first job.",
    )
    gpus_per_node = serializers.IntegerField(
        default=1,
        min_value=1,
        error_messages={"min_value": "must be at least 1 GPU", "invalid": "must be a whole number of GPUs"},
    )
    nodes = serializers.IntegerField(
        default=1,
        min_value=1,
        error_messages={"min_value": "must be at least 1 node", "invalid": "must be a whole number of nodes"},
    )
    gpu_type = serializers.CharField(required=False, allow_blank=True, max_length=64)
    priority = serializers.CharField(required=False, allow_blank=True, max_length=32)
    preemptible = serializers.BooleanField(required=False, allow_null=True, default=None)
    max_retries = serializers.IntegerField(
        default=0, min_value=0, max_value=100, error_messages={"max_value": "must be at most 100 retries"}
    )
    stop_on_hang = serializers.BooleanField(
        required=False, default=False, help_text="End the attempt when a hang is suspected (HANGAR_HANG_SECONDS)."
    )
    environment = serializers.CharField(required=False, allow_blank=True, max_length=64)
    max_runtime_seconds = serializers.IntegerField(
        required=False,
        min_value=1,
        error_messages={
            "min_value": "must be a positive number of seconds, e.g. 3600 for one hour",
            "invalid": "must be a whole number of seconds, e.g. 3600",
        },
    )

    code_version = serializers.CharField(required=False, allow_blank=True, max_length=200)
    config = serializers.JSONField(required=False)
    data_refs = serializers.ListField(child=serializers.CharField(), required=False)

    def get_fields(self) -> dict:
        # DRF deep-copies every declared field, nested ones too, for each instance: a
        # millisecond a submit. These fields keep nothing between validations (a test
        # checks two in a row), so shallow copies to bind to this instance are enough.
        return {name: copy.copy(field) for name, field in self._declared_fields.items()}

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields)) if isinstance(self.initial_data, dict) else []
        if unknown:
            raise serializers.ValidationError(
                {name: f"is not a job field; known fields are {', '.join(self.fields)}" for name in unknown}
            )
        self.check_capacity(attrs)
        self.check_volumes(attrs)
        attrs["priority"] = self.check_priority(attrs["project"], attrs.get("priority") or "")
        limit = attrs["project"].max_gpus_per_job
        if limit is not None and attrs["gpus_per_node"] * attrs["nodes"] > limit:
            total, slug = attrs["gpus_per_node"] * attrs["nodes"], attrs["project"].slug
            raise serializers.ValidationError(
                {"gpus_per_node": f"asks for {total} GPUs; project {slug} allows at most {limit} a job"}
            )
        self.warnings = [w for w in [check_budget(attrs["project"])] if w]
        return attrs

    def check_priority(self, project: Project, name: str) -> str:
        """The project's default class, or the one asked for if this user may use it."""
        classes = priority_classes()
        name = name or project.default_priority
        if name not in classes:
            raise serializers.ValidationError(
                {"priority": f"{name} is not a priority class; use one of {', '.join(classes)}"}
            )
        ceiling = priority_class(project.max_member_priority)
        if classes[name].rank > ceiling.rank and not self.is_manager(project):
            allowed = ", ".join(n for n, c in classes.items() if c.rank <= ceiling.rank)
            raise serializers.ValidationError(
                {"priority": f"{name} needs a manager of {project.slug}; members may use {allowed}"}
            )
        return name

    def is_manager(self, project: Project) -> bool:
        user = self.context["request"].user
        return Project.objects.with_role(user, Role.MANAGER).filter(pk=project.pk).exists()

    def validate_environment(self, name: str) -> Environment | None:
        if not name:
            return None
        environment = Environment.objects.filter(name=name).first()
        if environment is None:
            known = ", ".join(Environment.objects.values_list("name", flat=True)) or "none"
            raise serializers.ValidationError(f"no environment {name!r}; environments: {known}")
        return environment

    def validate_project(self, slug: str) -> Project:
        user = self.context["request"].user
        project = Project.objects.with_role(user, Role.MEMBER).filter(slug=slug).first()
        if project is None:
            mine = ", ".join(Project.objects.with_role(user, Role.MEMBER).values_list("slug", flat=True)) or "none"
            raise serializers.ValidationError(f"no project {slug!r} that you can submit to; your projects: {mine}")
        return project

    def validate_env(self, env: dict) -> dict:
        return check_env_names(env)

    def validate_secret_env(self, env: dict) -> dict:
        env = check_env_names(env)
        both = sorted(set(env) & set(self.initial_data.get("env") or {})) if isinstance(self.initial_data, dict) else []
        if both:
            raise serializers.ValidationError(f"{', '.join(both)} is also in env; give each variable in one of them")
        return env

    def check_volumes(self, attrs) -> None:
        """Each volume must exist in the project and the user's role must grant its mode."""
        wanted = attrs.get("volumes") or []
        project = attrs.get("project")
        if not wanted or project is None:
            return
        role = Project.objects.role_of(self.context["request"].user, project)
        known = {v.name: v for v in project.volumes.all()}
        granted = []
        for index, request in enumerate(wanted):
            volume = known.get(request["name"])
            field = f"volumes[{index}].name"
            if volume is None:
                names = ", ".join(known) or "none registered"
                raise serializers.ValidationError(
                    {field: f"project {project} has no volume {request['name']!r}; its volumes: {names}"}
                )
            if not volume.allows(role, request["mode"]):
                writing = request["mode"] == VolumeMode.READ_WRITE
                needed = volume.write_role if writing else volume.read_role
                fix = "; ask for mode ro" if writing else "; ask a project admin for a higher role"
                message = (
                    f"mounting {volume.name} {request['mode']} needs the {needed} role in {project}; you are {role}"
                )
                raise serializers.ValidationError({field: message + fix})
            granted.append(
                {"name": volume.name, "path": volume.path, "mode": request["mode"], "version": volume.version}
            )
        attrs["volumes"] = granted

    def check_capacity(self, attrs) -> None:
        gpus, gpu_type = attrs["gpus_per_node"], attrs.get("gpu_type", "")
        every = node_sizes()
        sizes = [count for model, count in every if not gpu_type or model == gpu_type]
        largest, big_enough = max(sizes, default=0), sum(1 for count in sizes if count >= gpus)
        if gpu_type and not largest:
            types = ", ".join(sorted({model for model, _ in every})) or "none registered"
            raise serializers.ValidationError({"gpu_type": f"no node has {gpu_type} GPUs; GPU types: {types}"})
        if gpus > largest:
            where = f"the largest {gpu_type} node" if gpu_type else "the largest node"
            raise serializers.ValidationError(
                {"gpus_per_node": f"gpus_per_node={gpus} but {where} has {largest}; ask for at most {largest}"}
            )
        if attrs["nodes"] > big_enough:
            kind = f"{gpu_type} " if gpu_type else ""
            raise serializers.ValidationError(
                {"nodes": f"nodes={attrs['nodes']} but only {big_enough} {kind}nodes have {gpus} GPUs; ask for fewer"}
            )

    def create(self, validated) -> Job:
        command = validated["command"]
        with transaction.atomic():
            job = Job.objects.create(
                project=validated["project"],
                submitted_by=self.context["request"].user,
                name=validated.get("name") or command[0].rsplit("/", 1)[-1],
                command=command,
                env=validated.get("env", {}),
                secret_env=validated.get("secret_env", {}),
                volumes=validated.get("volumes", []),
                idempotency_key=validated.get("idempotency_key", ""),
                gpus_per_node=validated["gpus_per_node"],
                nodes=validated["nodes"],
                gpu_type=validated.get("gpu_type", ""),
                priority=validated["priority"],
                preemptible=validated.get("preemptible"),
                max_retries=validated["max_retries"],
                stop_on_hang=validated.get("stop_on_hang", False),
                environment=validated.get("environment"),
                max_runtime_seconds=validated.get("max_runtime_seconds") or settings.HANGAR_DEFAULT_MAX_RUNTIME_SECONDS,
                code_version=validated.get("code_version", ""),
                config=validated.get("config") or {},
                data_refs=validated.get("data_refs", []),
            )
            JobEvent.objects.create(job=job, kind="submitted", message=f"by {job.submitted_by}")
            request_pass()
        return job


class EvidenceSerializer(serializers.Serializer):
    attempt = serializers.IntegerField(required=False, help_text="The attempt whose log line it is.")
    seq = serializers.IntegerField(required=False, help_text="The line's seq in that attempt's log.")
    rank = serializers.IntegerField(required=False)
    node = serializers.CharField(required=False)
    text = serializers.CharField()
    health_event = serializers.IntegerField(required=False)


class DiagnosisSerializer(serializers.Serializer):
    """Why an attempt failed (jobs/diagnosis.py)."""

    category = serializers.CharField(help_text="cuda_oom, host_oom, nan_loss, python_exception, ... or unknown.")
    summary = serializers.CharField()
    hint = serializers.CharField(help_text="What to change.")
    confidence = serializers.ChoiceField(choices=["high", "medium", "low"])
    first_failing_rank = serializers.IntegerField(allow_null=True, help_text="The rank whose error came first.")
    evidence = EvidenceSerializer(many=True)


class HangSerializer(serializers.Serializer):
    ranks = serializers.ListField(child=serializers.IntegerField(), help_text="The ranks flagged: silent, or behind.")
    summary = serializers.CharField()
    at = serializers.DateTimeField()


def diagnosis_of(attempt: Attempt | None) -> dict | None:
    found = attempt.diagnosis if attempt is not None else None
    if not found or "category" not in found:
        return None
    return {k: found[k] for k in ("category", "summary", "hint", "confidence", "first_failing_rank", "evidence")}


def hang_of(attempt: Attempt | None, key: str = "hang_suspected") -> dict | None:
    return (attempt.diagnosis or {}).get(key) if attempt is not None else None


class AttemptSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name")
    preflight_seconds = serializers.FloatField(read_only=True)
    running_seconds = serializers.FloatField(read_only=True)
    diagnosis = serializers.SerializerMethodField()
    hang_suspected = serializers.SerializerMethodField()
    straggler = serializers.SerializerMethodField()

    class Meta:
        model = Attempt
        fields = [
            "id",
            "number",
            "state",
            "node",
            "gpu_indices",
            "placement",
            "borrowed",
            "queued_at",
            "scheduled_at",
            "started_at",
            "running_at",
            "finished_at",
            "exit_code",
            "failure_class",
            "reason",
            "preflight_seconds",
            "running_seconds",
            "diagnosis",
            "hang_suspected",
            "straggler",
        ]

    @extend_schema_field(DiagnosisSerializer(allow_null=True))
    def get_diagnosis(self, attempt: Attempt) -> dict | None:
        return diagnosis_of(attempt)

    @extend_schema_field(HangSerializer(allow_null=True))
    def get_hang_suspected(self, attempt: Attempt) -> dict | None:
        return hang_of(attempt)

    @extend_schema_field(HangSerializer(allow_null=True))
    def get_straggler(self, attempt: Attempt) -> dict | None:
        return hang_of(attempt, "straggler")


class JobSerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug")
    environment = serializers.CharField(source="environment.name", default=None)
    submitted_by = serializers.CharField(source="submitted_by.username")
    attempts = AttemptSerializer(many=True, read_only=True)
    secret_env = serializers.SerializerMethodField(help_text="Names of the secret variables; values are never shown.")
    urls = serializers.SerializerMethodField()
    diagnosis = serializers.SerializerMethodField(help_text="Why its latest attempt failed; null when it did not.")
    hang_suspected = serializers.SerializerMethodField(help_text="Set while its running attempt seems hung.")

    class Meta:
        model = Job
        fields = [
            "id",
            "name",
            "project",
            "submitted_by",
            "command",
            "env",
            "secret_env",
            "volumes",
            "idempotency_key",
            "gpus_per_node",
            "nodes",
            "gpu_type",
            "priority",
            "preemptible",
            "environment",
            "max_runtime_seconds",
            "max_retries",
            "retries",
            "preemptions",
            "state",
            "state_reason",
            "exit_code",
            "failure_class",
            "requeues",
            "stop_on_hang",
            "diagnosis",
            "hang_suspected",
            "created_at",
            "queued_at",
            "finished_at",
            "attempts",
            "urls",
            "code_version",
            "config",
            "data_refs",
            "mlflow_experiment_id",
            "mlflow_run_id",
            "tracking_error",
        ]

    def to_representation(self, job: Job) -> dict:
        """What the declared fields give, written out (a test compares the two): building a
        ModelSerializer's ~35 fields cost more than the rest of a submit's response."""
        return {
            "id": job.pk,
            "name": job.name,
            "project": job.project.slug,
            "submitted_by": job.submitted_by.username,
            "command": job.command,
            "env": job.env,
            "secret_env": self.get_secret_env(job),
            "volumes": job.volumes,
            "idempotency_key": job.idempotency_key,
            "gpus_per_node": job.gpus_per_node,
            "nodes": job.nodes,
            "gpu_type": job.gpu_type,
            "priority": job.priority,
            "preemptible": job.preemptible,
            "environment": job.environment.name if job.environment_id is not None else None,
            "max_runtime_seconds": job.max_runtime_seconds,
            "max_retries": job.max_retries,
            "retries": job.retries,
            "preemptions": job.preemptions,
            "state": job.state,
            "state_reason": job.state_reason,
            "exit_code": job.exit_code,
            "failure_class": job.failure_class,
            "requeues": job.requeues,
            "stop_on_hang": job.stop_on_hang,
            "diagnosis": self.get_diagnosis(job),
            "hang_suspected": self.get_hang_suspected(job),
            "created_at": DATETIME.to_representation(job.created_at),
            "queued_at": DATETIME.to_representation(job.queued_at),
            "finished_at": DATETIME.to_representation(job.finished_at),
            "attempts": self.attempts_json(job),
            "urls": self.get_urls(job),
            "code_version": job.code_version,
            "config": job.config,
            "data_refs": job.data_refs,
            "mlflow_experiment_id": job.mlflow_experiment_id,
            "mlflow_run_id": job.mlflow_run_id,
            "tracking_error": job.tracking_error,
        }

    def attempts_json(self, job: Job) -> list[dict]:
        if self.context.get("created"):  # a job just submitted has none: no query
            return []
        attempts = job.attempts.all()
        if not attempts:
            return []
        # One list serializer per JobSerializer: a page of jobs builds the attempt fields once.
        if not hasattr(self, "_attempts"):
            self._attempts = AttemptSerializer(many=True, context=self.context)
        return self._attempts.to_representation(attempts)

    def latest(self, job: Job) -> Attempt | None:
        if self.context.get("created"):
            return None
        memo = self.__dict__.setdefault("_latest", {})  # diagnosis and hang read it: one query at most
        if job.pk not in memo:
            attempts = list(job.attempts.all())  # prefetched with the job where a page lists many
            memo[job.pk] = max(attempts, key=lambda a: a.number) if attempts else None
        return memo[job.pk]

    @extend_schema_field(DiagnosisSerializer(allow_null=True))
    def get_diagnosis(self, job: Job) -> dict | None:
        return diagnosis_of(self.latest(job))

    @extend_schema_field(HangSerializer(allow_null=True))
    def get_hang_suspected(self, job: Job) -> dict | None:
        return hang_of(self.latest(job))

    def get_secret_env(self, job: Job) -> dict[str, str]:
        return dict.fromkeys(job.secret_env, SECRET_MASK)

    def get_urls(self, job: Job) -> dict[str, str]:
        return {
            "api": f"/api/v1/jobs/{job.pk}/",
            "page": f"/jobs/{job.pk}/",
            "logs": f"/api/v1/jobs/{job.pk}/logs/",
            "logs_ws": f"/ws/jobs/{job.pk}/logs/",
        }
