"""/api/v1/pipelines/: submit a pipeline (jobs/pipelines.py), list and read its runs,
cancel one, run one again (whole, or from a stage)."""

import io
import json

from django.db import IntegrityError
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from jobs import pipelines
from jobs.api.views import REASON, AlreadyEnded, IdempotencyConflict, idempotency_key
from jobs.models import PipelineRun, PipelineStage, PipelineState, pipeline_state
from jobs.models.pipeline import CopyState
from jobs.submission import held_by_key
from portal.inputs import JSONParser

RERUN = inline_serializer(
    "PipelineRerun",
    {
        "from_stage": serializers.CharField(required=False, allow_blank=True),
        "secret_env": serializers.DictField(child=serializers.CharField(), required=False),
    },
)


class DuplicateKey(ValueError):
    pass


def no_duplicates(pairs: list[tuple]) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKey(key)
        seen[key] = value
    return seen


class PipelineParser(JSONParser):
    """The API's JSON parser, refusing a key given twice in one object: JSON would silently
    keep the last of two stages of one name."""

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read() if stream is not None else b""
        try:
            json.loads(raw, object_pairs_hook=no_duplicates)
        except DuplicateKey as exc:
            raise serializers.ValidationError(
                {"stages": f"{exc.args[0]!r} is given twice in one object (two stages of one name?); give each once"}
            )
        except ValueError:
            pass  # not JSON: the parser below says so
        return super().parse(io.BytesIO(raw), media_type, parser_context)


def seconds(start, end) -> float | None:
    if start is None:
        return None
    return round(((end or timezone.now()) - start).total_seconds(), 3)


def stage_json(stage: PipelineStage) -> dict:
    job = stage.job
    attempts = sorted(job.attempts.all(), key=lambda a: a.number)
    started = next((a.running_at or a.started_at for a in attempts if a.running_at or a.started_at), None)
    cost = getattr(job, "cost", None)
    return {
        "name": stage.name,
        "needs": stage.needs,
        "reused": stage.reused,
        "job": job.pk,
        "state": job.state,
        "state_reason": job.state_reason,
        "started_at": started,
        "finished_at": job.finished_at,
        "duration_seconds": seconds(started, job.finished_at) if started else None,
        "cost": float(cost.cost) if cost is not None else 0.0,
        "urls": {"job": f"/api/v1/jobs/{job.pk}/", "page": f"/jobs/{job.pk}/"},
    }


def copy_json(run: PipelineRun) -> dict | None:
    """How far a rerun's copy of the earlier run's directory got; None when the run copies nothing."""
    if not run.copy_state:
        return None
    return {
        "state": run.copy_state,
        "bytes": run.copy_bytes,
        "total": run.copy_total,
        "reason": run.copy_reason,
        "from_run": run.rerun_of_id,
    }


def run_json(run: PipelineRun) -> dict:
    stages = [stage_json(s) for s in run.stages.all()]
    state = pipeline_state([s["state"] for s in stages])
    return {
        "id": run.pk,
        "name": run.name,
        "project": run.project.slug,
        "submitted_by": run.submitted_by.username,
        "state": state,
        "stopped_reason": pipelines.stopped_reason([s["state_reason"] for s in stages]),
        "created_at": run.created_at,
        "directory": run.directory,
        "params": run.params,
        "rerun_of": run.rerun_of_id,
        "from_stage": run.from_stage,
        "copy": copy_json(run),
        "mlflow_run_id": run.mlflow_run_id,
        "stages": stages,
        # What this run spent: a reused stage's cost was spent by the run that ran it.
        "cost": round(sum(s["cost"] for s in stages if not s["reused"]), 4),
        "urls": {"api": f"/api/v1/pipelines/{run.pk}/", "page": f"/pipelines/{run.pk}/"},
    }


class PipelineStageSerializer(serializers.Serializer):
    name = serializers.CharField()
    needs = serializers.ListField(child=serializers.CharField(), help_text="The stages it waits for.")
    reused = serializers.BooleanField(help_text="A rerun's stage not run again: the earlier run's job.")
    job = serializers.IntegerField()
    state = serializers.CharField()
    state_reason = serializers.CharField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)
    duration_seconds = serializers.FloatField(allow_null=True)
    cost = serializers.FloatField()
    urls = serializers.DictField(child=serializers.CharField())


class PipelineCopySerializer(serializers.Serializer):
    state = serializers.ChoiceField(choices=CopyState.choices)
    bytes = serializers.IntegerField(help_text="Bytes of data copied so far (holes not counted).")
    total = serializers.IntegerField(help_text="Bytes of data the copy found to copy.")
    reason = serializers.CharField(help_text="Why it failed, or what it left out.")
    from_run = serializers.IntegerField(allow_null=True)


class PipelineRunSerializer(serializers.Serializer):
    """A pipeline run as the API shows it: what the declared fields say, written out by run_json."""

    id = serializers.IntegerField()
    name = serializers.CharField()
    project = serializers.CharField()
    submitted_by = serializers.CharField()
    state = serializers.ChoiceField(choices=PipelineState.choices)
    stopped_reason = serializers.CharField(
        help_text="Why its waiting stages were cancelled: its token was revoked, or its submitter deactivated "
        "or out of the project; empty otherwise."
    )
    created_at = serializers.DateTimeField()
    directory = serializers.CharField(help_text="HANGAR_PIPELINE_DIR of its stages.")
    params = serializers.DictField(child=serializers.CharField())
    rerun_of = serializers.IntegerField(allow_null=True)
    from_stage = serializers.CharField()
    copy = PipelineCopySerializer(
        allow_null=True,
        help_text="A rerun from a stage: its first stage's copy of the earlier run's directory; null otherwise.",
    )
    mlflow_run_id = serializers.CharField(help_text="The parent run of its stages' MLflow runs.")
    stages = PipelineStageSerializer(many=True)
    cost = serializers.FloatField(help_text="What this run spent (reused stages not counted).")
    urls = serializers.DictField(child=serializers.CharField())

    def to_representation(self, run: PipelineRun) -> dict:
        return run_json(run)


class PipelineViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Pipelines: a body like the pipeline file (project, name, params, defaults, stages)."""

    serializer_class = PipelineRunSerializer
    queryset = PipelineRun.objects.none()  # for the schema; requests use get_queryset
    lookup_value_regex = r"\d+"
    parser_classes = [PipelineParser]

    def get_queryset(self):
        runs = PipelineRun.objects.visible_to(self.request.user).select_related("project", "submitted_by")
        if project := self.request.query_params.get("project"):
            runs = runs.filter(project__slug=project)
        return runs.prefetch_related("stages__job__attempts", "stages__job__cost")

    @extend_schema(request=OpenApiTypes.OBJECT, responses={201: PipelineRunSerializer, 200: PipelineRunSerializer})
    def create(self, request):
        document = request.data
        key = idempotency_key(request, document) if isinstance(document, dict) else ""
        if key and (first := self.replay(key, document)) is not None:
            return first
        try:
            body = {**document, "idempotency_key": key} if key else document
            submitted = pipelines.submit_pipeline(request.user, body)
        except IntegrityError:
            if key and (first := self.replay(key, document)) is not None:  # two retries raced
                return first
            raise
        return Response({**run_json(submitted.run), "warnings": submitted.warnings}, status=status.HTTP_201_CREATED)

    def replay(self, key: str, document: dict) -> Response | None:
        user = self.request.user
        mine = PipelineRun.objects.filter(submitted_by=user, idempotency_key=key)
        run = held_by_key(mine, PipelineRun.objects.visible_to(user))
        if run is None:
            return None
        if document.get("project") != run.project.slug or pipelines.without_secrets(
            {**document, "idempotency_key": key}
        ).get("stages") != run.document.get("stages"):
            raise IdempotencyConflict(
                f"Idempotency-Key {key!r} was used for pipeline run {run.pk} with other stages; use a new key"
            )
        return Response(run_json(run), headers={"Idempotent-Replayed": "true"})

    @extend_schema(request=REASON, responses={200: PipelineRunSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        run = self.get_object()
        if not pipelines.can_manage(request.user, run):
            raise PermissionDenied("only the pipeline's submitter or a manager of its project can cancel it")
        if pipeline_state([s.job.state for s in run.stages.all()]) != "running":
            raise AlreadyEnded(f"pipeline run {run.pk} already ended; there is nothing to cancel")
        reason = str(request.data.get("reason", "")) if isinstance(request.data, dict) else ""
        cancelled = pipelines.cancel(run, request.user, reason)
        run = self.get_queryset().get(pk=run.pk)
        return Response({**run_json(run), "cancelled_stages": cancelled})

    @extend_schema(request=RERUN, responses={201: PipelineRunSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def rerun(self, request, pk=None):
        """Run it again once every stage ended (409 before, naming the stage still going): every
        stage, or {"from_stage": "evaluate"}: that stage and every stage downstream of it; the
        others' jobs are reused and the new directory is a copy of this run's, made by the first
        stage's attempt before its command (`copy` shows how far it got)."""
        run = self.get_object()
        body = request.data if isinstance(request.data, dict) else {}
        from_stage = body.get("from_stage") or ""
        if not isinstance(from_stage, str):
            raise serializers.ValidationError({"from_stage": "must be the name of a stage, e.g. evaluate"})
        submitted = pipelines.rerun(request.user, run, from_stage, body.get("secret_env"))
        again = self.get_queryset().get(pk=submitted.run.pk)
        return Response({**run_json(again), "warnings": submitted.warnings}, status=status.HTTP_201_CREATED)
