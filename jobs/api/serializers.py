import copy
import re

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from jobs import jobspec, logmetrics
from jobs.models import Attempt, Job
from jobs.submission import submit_job
from portal.models import VolumeMode
from portal.patterns import PatternError

SECRET_MASK = "********"
DATETIME = serializers.DateTimeField()  # formats as the API's datetimes do (ISO 8601, Z for UTC)

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ARGV_EXAMPLE = '["python", "train.py", "--epochs", "3"]'


def type_name(value) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", dict: "an object", list: "a list"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


class Text(serializers.CharField):
    """A string as sent: a number or a boolean is refused, not silently turned into text
    (`"env": {"A": 1}` would run with "1"; `"command": [1]` would fail at start)."""

    default_error_messages = {
        "invalid": "must be a string (in double quotes); got {input_type}",
        "null": "must be a string (in double quotes); got null",
    }

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid", input_type=type_name(data))
        return super().to_internal_value(data)


class TextMap(serializers.DictField):
    """NAME -> string: an object whose values are strings."""

    default_error_messages = {
        "not_a_dict": 'must be an object of NAME: "value" pairs, e.g. {{"EPOCHS": "3"}}; got {input_type}',
        "empty": "must not be empty",
    }

    def __init__(self, **kwargs):
        super().__init__(child=Text(allow_blank=True, trim_whitespace=False), **kwargs)

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            self.fail("not_a_dict", input_type=type_name(data))
        return super().to_internal_value(data)


class ArgvField(serializers.ListField):
    """A command as an argv list of strings. A string is refused: the API never splits or shells it."""

    def __init__(self, **kwargs):
        super().__init__(child=Text(allow_blank=True, trim_whitespace=False), **kwargs)

    def to_internal_value(self, data):
        if isinstance(data, str):
            self.fail("not_a_list", input_type="string")
        argv = super().to_internal_value(data)
        if not argv or not argv[0].strip():
            self.fail("empty")
        return argv


@extend_schema_field(
    {
        "oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}],
        "example": ["six==1.17.0", "numpy>=2"],
    }
)
class RequirementsField(serializers.Field):
    """Python requirements: a list of specifiers, or a requirements.txt's text (one a line)."""

    default_error_messages = {
        "invalid": 'must be a list of requirement specifiers, e.g. ["six==1.17.0", "numpy>=2"], or the text '
        "of a requirements.txt; got {input_type}"
    }

    def to_internal_value(self, data) -> list[str]:
        if not isinstance(data, str) and not (isinstance(data, list) and all(isinstance(x, str) for x in data)):
            self.fail("invalid", input_type=type_name(data))
        try:
            return jobspec.parse_requirements(data)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc))

    def to_representation(self, value) -> list[str]:
        return list(value)


def check_env_names(env: dict) -> dict:
    for key in env:
        if not ENV_NAME.match(key):
            raise serializers.ValidationError(
                f"{key!r} is not a valid variable name; use letters, digits and '_', not starting with a digit"
            )
        if problem := jobspec.env_problem([key]):
            raise serializers.ValidationError(problem)
    return env


class VolumeRequestSerializer(serializers.Serializer):
    name = serializers.SlugField(max_length=64)
    mode = serializers.ChoiceField(
        choices=VolumeMode.choices,
        default=VolumeMode.READ,
        error_messages={"invalid_choice": "{input} is not a volume mode; use ro (read-only) or rw (read-write)"},
    )


class DependencySerializer(serializers.Serializer):
    job = serializers.IntegerField(min_value=1, error_messages={"invalid": "must be a job id, e.g. 12"})
    on = serializers.ChoiceField(
        choices=["succeeded", "finished"],
        default="succeeded",
        error_messages={"invalid_choice": "{input} is not a condition; use succeeded or finished (any end)"},
    )


OBJECTIVE_MODES = ["min", "max"]


class ObjectiveSerializer(serializers.Serializer):
    """What a job is scored by: one of its metrics, and whether lower or higher is better."""

    metric = Text(
        max_length=logmetrics.MAX_NAME_CHARS,
        error_messages={"required": "is required: the name of a metric the job logs, e.g. val_loss"},
    )
    mode = serializers.ChoiceField(
        choices=OBJECTIVE_MODES,
        error_messages={
            "required": "is required: min (lower is better, a loss) or max (higher is better, an accuracy)",
            "invalid_choice": "{input} is not a mode; use min (lower is better) or max (higher is better)",
        },
    )

    def to_internal_value(self, data):
        if isinstance(data, dict) and (unknown := sorted(set(data) - {"metric", "mode"})):
            raise serializers.ValidationError(
                {name: "is not an objective field; give metric and mode only" for name in unknown}
            )
        return super().to_internal_value(data)


class CodeSerializer(serializers.Serializer):
    """The code a job runs in (`hangar submit --code DIR`): a snapshot uploaded to its project
    (PUT /api/v1/projects/<slug>/snapshots/<sha256>/) and, from a git work tree, its facts."""

    snapshot = serializers.RegexField(
        r"^[0-9a-f]{64}$",
        error_messages={
            "invalid": "must be the sha256 of an uploaded snapshot (64 lowercase hex digits)",
            "required": "is required: the sha256 of a snapshot uploaded to the job's project",
        },
    )
    commit = Text(required=False, allow_blank=True, max_length=64)
    branch = Text(required=False, allow_blank=True, max_length=200)
    dirty = serializers.BooleanField(required=False)
    diff = Text(required=False, allow_blank=True, trim_whitespace=False, help_text="`git diff HEAD`; capped.")
    diff_truncated = serializers.BooleanField(required=False)

    def to_internal_value(self, data):
        if isinstance(data, dict) and (unknown := sorted(set(data) - set(self.fields))):
            raise serializers.ValidationError(
                {name: f"is not a field of code; known fields are {', '.join(self.fields)}" for name in unknown}
            )
        return super().to_internal_value(data)


class JobSubmitSerializer(serializers.Serializer):
    default_error_messages = {
        "invalid": 'the body must be a JSON object of job fields, e.g. {{"project": "vision", "command": ["python", '
        '"train.py"]}}; got {datatype}'
    }

    name = Text(max_length=200, required=False, allow_blank=True)
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
    env = TextMap(required=False)
    secret_env = TextMap(
        required=False,
        help_text="Variables given to the job but never shown back (masked in pages, API and audit).",
    )
    volumes = VolumeRequestSerializer(many=True, required=False)
    depends_on = DependencySerializer(
        many=True,
        required=False,
        help_text='Jobs of the same project to wait for: [{"job": 12, "on": "succeeded" | "finished"}]; '
        "the job is blocked until then.",
    )
    idempotency_key = Text(
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
    gpu_type = Text(required=False, allow_blank=True, max_length=64)
    priority = Text(required=False, allow_blank=True, max_length=32)
    preemptible = serializers.BooleanField(required=False, allow_null=True, default=None)
    max_retries = serializers.IntegerField(
        default=0, min_value=0, max_value=100, error_messages={"max_value": "must be at most 100 retries"}
    )
    stop_on_hang = serializers.BooleanField(
        required=False, default=False, help_text="End the attempt when a hang is suspected (HANGAR_HANG_SECONDS)."
    )
    environment = Text(required=False, allow_blank=True, max_length=64)
    requirements = RequirementsField(
        required=False,
        help_text="Python packages of its cached environment, built once per node (uv) and reused: a list of "
        "specifiers or a requirements.txt's text.",
    )
    python_version = Text(
        required=False, allow_blank=True, max_length=16, help_text="With requirements: e.g. 3.11; blank: the node's."
    )
    launcher = serializers.ChoiceField(
        choices=jobspec.LAUNCHERS,
        required=False,
        allow_blank=True,
        help_text="ray: the job's nodes form a Ray cluster (ray from its requirements) and rank 0 runs the command "
        "as its driver with RAY_ADDRESS set; torchrun: torch.distributed.run starts one process per GPU on each "
        "node (nproc_per_node = gpus_per_node) with the torchrun variables; blank: the command runs once per node.",
        error_messages={
            "invalid_choice": '"{input}" is not a launcher; use "ray" or "torchrun", or leave it out to run the '
            "command once per node"
        },
    )
    max_runtime_seconds = serializers.IntegerField(
        required=False,
        min_value=1,
        error_messages={
            "min_value": "must be a positive number of seconds, e.g. 3600 for one hour",
            "invalid": "must be a whole number of seconds, e.g. 3600",
        },
    )

    code_version = Text(required=False, allow_blank=True, max_length=200)
    code = CodeSerializer(required=False, help_text="The code snapshot to run in, and its git commit, branch, diff.")
    config = serializers.JSONField(required=False)
    data_refs = serializers.ListField(
        child=Text(),
        required=False,
        error_messages={"not_a_list": 'must be a list of strings, e.g. ["s3://bucket/imagenet@v3"]; got {input_type}'},
    )

    objective = ObjectiveSerializer(
        required=False,
        help_text='What the job is scored by: {"metric": "val_loss", "mode": "min"}; its value is in the result.',
    )
    metrics_from_log = Text(
        required=False,
        allow_blank=True,
        max_length=500,
        help_text="An RE2 pattern with the named groups name and value (and optionally step): lines of rank 0 "
        r"that match are logged to the job's MLflow run, e.g. (?P<name>val_loss): (?P<value>[-+0-9.eE]+)",
    )

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
        return attrs

    def validate_env(self, env: dict) -> dict:
        return check_env_names(env)

    def validate_metrics_from_log(self, text: str) -> str:
        if text:
            try:
                logmetrics.compile_pattern(text)
            except PatternError as exc:
                raise serializers.ValidationError(exc.message)
        return text

    def validate_python_version(self, version: str) -> str:
        if problem := jobspec.python_problem(version):
            raise serializers.ValidationError(problem)
        return version

    def validate_secret_env(self, env: dict) -> dict:
        env = check_env_names(env)
        both = sorted(set(env) & set(self.initial_data.get("env") or {})) if isinstance(self.initial_data, dict) else []
        if both:
            raise serializers.ValidationError(f"{', '.join(both)} is also in env; give each variable in one of them")
        return env

    def save(self, **kwargs) -> Job:
        """Submit the checked request as the request's user (jobs/submission.py decides and creates)."""
        submitted = submit_job(self.context["request"].user, self.validated_data, self.context.get("copy_of"))
        self.warnings = submitted.warnings
        self.instance = submitted.job
        return submitted.job


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


class CodeOfJobSerializer(serializers.Serializer):
    snapshot = serializers.CharField(help_text="sha256 of the tar.gz.")
    size = serializers.IntegerField(help_text="Bytes of the tar.gz.")
    files = serializers.IntegerField()
    commit = serializers.CharField(required=False)
    branch = serializers.CharField(required=False)
    dirty = serializers.BooleanField(required=False)
    diff_truncated = serializers.BooleanField()
    available = serializers.BooleanField(help_text="False once retention deleted the snapshot.")
    urls = serializers.DictField(child=serializers.CharField(), help_text="download (tar.gz) and diff (text).")


class AttemptSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name")
    preflight_seconds = serializers.FloatField(read_only=True, allow_null=True)
    running_seconds = serializers.FloatField(read_only=True, allow_null=True)
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
            "environment",
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
    environment = serializers.CharField(source="environment.name", default=None, allow_null=True)
    submitted_by = serializers.CharField(source="submitted_by.username")
    attempts = AttemptSerializer(many=True, read_only=True)
    secret_env = serializers.SerializerMethodField(help_text="Names of the secret variables; values are never shown.")
    urls = serializers.SerializerMethodField()
    diagnosis = serializers.SerializerMethodField(help_text="Why its latest attempt failed; null when it did not.")
    hang_suspected = serializers.SerializerMethodField(help_text="Set while its running attempt seems hung.")
    code = serializers.SerializerMethodField(help_text="Its code snapshot and git facts; null: none.")

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
            "requirements",
            "python_version",
            "launcher",
            "max_runtime_seconds",
            "max_retries",
            "retries",
            "preemptions",
            "state",
            "state_reason",
            "depends_on",
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
            "code",
            "config",
            "data_refs",
            "mlflow_experiment_id",
            "mlflow_run_id",
            "tracking_error",
            "objective",
            "metrics_from_log",
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
            "requirements": job.requirements,
            "python_version": job.python_version,
            "launcher": job.launcher,
            "max_runtime_seconds": job.max_runtime_seconds,
            "max_retries": job.max_retries,
            "retries": job.retries,
            "preemptions": job.preemptions,
            "state": job.state,
            "state_reason": job.state_reason,
            "depends_on": job.depends_on,
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
            "code": self.get_code(job),
            "config": job.config,
            "data_refs": job.data_refs,
            "mlflow_experiment_id": job.mlflow_experiment_id,
            "mlflow_run_id": job.mlflow_run_id,
            "tracking_error": job.tracking_error,
            "objective": job.objective,
            "metrics_from_log": job.metrics_from_log,
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

    @extend_schema_field(CodeOfJobSerializer(allow_null=True))
    def get_code(self, job: Job) -> dict | None:
        if not job.code:
            return None
        urls = {"download": f"/api/v1/jobs/{job.pk}/code/", "diff": f"/api/v1/jobs/{job.pk}/code/diff/"}
        return {**job.code, "available": job.snapshot_id is not None, "urls": urls}

    def get_secret_env(self, job: Job) -> dict[str, str]:
        return dict.fromkeys(job.secret_env, SECRET_MASK)

    def get_urls(self, job: Job) -> dict[str, str]:
        return {
            "api": f"/api/v1/jobs/{job.pk}/",
            "page": f"/jobs/{job.pk}/",
            "logs": f"/api/v1/jobs/{job.pk}/logs/",
            "logs_ws": f"/ws/jobs/{job.pk}/logs/",
            "result": f"/api/v1/jobs/{job.pk}/result/",
        }
