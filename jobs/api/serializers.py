import re

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from rest_framework import serializers

from fleet.models import Node
from jobs.api.costs import check_budget
from jobs.models import Attempt, Job, JobEvent, Priority
from jobs.scheduler import request_pass
from portal.models import Project, Role

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
    gpus_per_node = serializers.IntegerField(
        default=1,
        min_value=1,
        error_messages={"min_value": "must be at least 1 GPU", "invalid": "must be a whole number of GPUs"},
    )
    nodes = serializers.IntegerField(
        default=1,
        min_value=1,
        max_value=1,
        error_messages={"max_value": "multi-node jobs are not supported yet; use nodes=1", "min_value": "must be 1"},
    )
    gpu_type = serializers.CharField(required=False, allow_blank=True, max_length=64)
    priority = serializers.ChoiceField(
        choices=Priority.choices,
        default=Priority.NORMAL,
        error_messages={
            "invalid_choice": f"{{input}} is not a priority class; use one of {', '.join(Priority.values)}"
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

    code_version = serializers.CharField(required=False, allow_blank=True, max_length=200)
    environment = serializers.CharField(required=False, allow_blank=True, max_length=200)
    config = serializers.JSONField(required=False)
    data_refs = serializers.ListField(child=serializers.CharField(), required=False)

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields)) if isinstance(self.initial_data, dict) else []
        if unknown:
            raise serializers.ValidationError(
                {name: f"is not a job field; known fields are {', '.join(self.fields)}" for name in unknown}
            )
        self.check_capacity(attrs)
        check_budget(attrs["project"])
        return attrs

    def validate_project(self, slug: str) -> Project:
        user = self.context["request"].user
        project = Project.objects.with_role(user, Role.MEMBER).filter(slug=slug).first()
        if project is None:
            mine = ", ".join(Project.objects.with_role(user, Role.MEMBER).values_list("slug", flat=True)) or "none"
            raise serializers.ValidationError(f"no project {slug!r} that you can submit to; your projects: {mine}")
        return project

    def validate_env(self, env: dict) -> dict:
        for key in env:
            if not ENV_NAME.match(key):
                raise serializers.ValidationError(
                    f"{key!r} is not a valid variable name; use letters, digits and '_', not starting with a digit"
                )
            if key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIX):
                raise serializers.ValidationError(f"{key} is set by Hangar for each attempt; remove it from env")
        return env

    def check_capacity(self, attrs) -> None:
        gpus, gpu_type = attrs["gpus_per_node"], attrs.get("gpu_type", "")
        nodes = Node.objects.all()
        if gpu_type:
            if not nodes.filter(gpu_model=gpu_type).exists():
                types = ", ".join(sorted(set(nodes.values_list("gpu_model", flat=True)))) or "none registered"
                raise serializers.ValidationError({"gpu_type": f"no node has {gpu_type} GPUs; GPU types: {types}"})
            nodes = nodes.filter(gpu_model=gpu_type)
        largest = nodes.aggregate(m=Max("gpu_count"))["m"] or 0
        if gpus > largest:
            where = f"the largest {gpu_type} node" if gpu_type else "the largest node"
            raise serializers.ValidationError(
                {"gpus_per_node": f"gpus_per_node={gpus} but {where} has {largest}; ask for at most {largest}"}
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
                gpus_per_node=validated["gpus_per_node"],
                nodes=validated["nodes"],
                gpu_type=validated.get("gpu_type", ""),
                priority=validated["priority"],
                max_runtime_seconds=validated.get("max_runtime_seconds") or settings.HANGAR_DEFAULT_MAX_RUNTIME_SECONDS,
                code_version=validated.get("code_version", ""),
                environment=validated.get("environment", ""),
                config=validated.get("config") or {},
                data_refs=validated.get("data_refs", []),
            )
            JobEvent.objects.create(job=job, kind="submitted", message=f"by {job.submitted_by}")
            request_pass()
        return job


class AttemptSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name")
    preflight_seconds = serializers.FloatField(read_only=True)
    running_seconds = serializers.FloatField(read_only=True)

    class Meta:
        model = Attempt
        fields = [
            "id",
            "number",
            "state",
            "node",
            "gpu_indices",
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
        ]


class JobSerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug")
    submitted_by = serializers.CharField(source="submitted_by.username")
    attempts = AttemptSerializer(many=True, read_only=True)
    urls = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id",
            "name",
            "project",
            "submitted_by",
            "command",
            "env",
            "gpus_per_node",
            "nodes",
            "gpu_type",
            "priority",
            "max_runtime_seconds",
            "state",
            "state_reason",
            "exit_code",
            "failure_class",
            "requeues",
            "created_at",
            "queued_at",
            "finished_at",
            "attempts",
            "urls",
            "code_version",
            "environment",
            "config",
            "data_refs",
            "mlflow_experiment_id",
            "mlflow_run_id",
            "tracking_error",
        ]

    def get_urls(self, job: Job) -> dict:
        return {
            "api": f"/api/v1/jobs/{job.pk}/",
            "page": f"/jobs/{job.pk}/",
            "logs": f"/api/v1/jobs/{job.pk}/logs/",
            "logs_ws": f"/ws/jobs/{job.pk}/logs/",
        }
