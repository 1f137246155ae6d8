from dataclasses import asdict

from django.db import IntegrityError
from django.db.models import Q
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import jobspec, reproduce, results
from jobs.api.resultshape import ResultSerializer
from jobs.api.serializers import AttemptSerializer, JobSerializer, JobSubmitSerializer
from jobs.models import ACTIVE_ATTEMPT_STATES, Attempt, Job, JobState, priority_classes
from jobs.scheduler import queue_report
from jobs.submission import IdempotencyConflict, held_by_key
from portal.inputs import InputError, whole_number
from portal.models import Project, Role

IDEMPOTENCY_HEADER = OpenApiParameter(
    "Idempotency-Key",
    OpenApiTypes.STR,
    OpenApiParameter.HEADER,
    description="A retried submit with the same key returns the first job (200) instead of creating another.",
)
REASON = inline_serializer("Reason", {"reason": serializers.CharField(required=False, allow_blank=True)})


class AlreadyEnded(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "already_ended"


def replay_differences(job: Job, data: dict) -> list[str]:
    """What a submit retried with a job's Idempotency-Key asks for differently from that job:
    its project, command, code snapshot or environment variables (an agent's variants differ
    in these); empty when it is the same submit."""
    code = data.get("code") if isinstance(data.get("code"), dict) else {}
    asked = {
        "project": data.get("project"),
        "command": data.get("command"),
        "code": code.get("snapshot") or "",
        "env": data.get("env") or {},
    }
    had = {
        "project": job.project.slug,
        "command": job.command,
        "code": job.code.get("snapshot") or "",
        "env": job.env,
    }
    return [name for name in asked if asked[name] != had[name]]


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = JobSerializer
    queryset = Job.objects.none()  # for the schema; requests use get_queryset
    lookup_value_regex = r"\d+"

    def get_queryset(self):
        jobs = Job.objects.visible_to(self.request.user).select_related("project", "submitted_by", "environment")
        return filter_jobs(jobs, self.request.query_params, self.request.user).prefetch_related("attempts__node")

    @extend_schema(
        parameters=[
            OpenApiParameter("state", enum=["", *JobState.values]),
            OpenApiParameter("project", str),
            OpenApiParameter("submitted_by", str, description="a username, or `me`"),
            OpenApiParameter("name", str, description="part of the job's name"),
        ]
    )
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(
        request=JobSubmitSerializer,
        responses={201: JobSerializer, 200: JobSerializer},
        parameters=[IDEMPOTENCY_HEADER],
    )
    def create(self, request):
        data = request.data if isinstance(request.data, dict) else {}
        key = idempotency_key(request, data)
        if key and (first := self.replay(key, data)) is not None:
            return first
        submit = JobSubmitSerializer(
            data={**data, "idempotency_key": key} if key else request.data, context={"request": request}
        )
        submit.is_valid(raise_exception=True)
        try:
            job = submit.save()
        except IntegrityError:
            # Two retries of one submit raced; the other one's job is the answer.
            if key and (first := self.replay(key, data)) is not None:
                return first
            raise
        body = JobSerializer(job, context={"created": True}).data
        body["warnings"] = submit.warnings
        return Response(body, status=status.HTTP_201_CREATED)

    def replay(self, key: str, data: dict) -> Response | None:
        user = self.request.user
        job = held_by_key(Job.objects.filter(submitted_by=user, idempotency_key=key), Job.objects.visible_to(user))
        if job is None:
            return None
        if differs := replay_differences(job, data):
            raise IdempotencyConflict(
                f"Idempotency-Key {key!r} was used for job {job.pk} with another {' and '.join(differs)}; "
                "use a new key for a different job"
            )
        return Response(JobSerializer(job).data, status=status.HTTP_200_OK, headers={"Idempotent-Replayed": "true"})

    @extend_schema(request=REASON, responses={200: JobSerializer, 409: OpenApiTypes.OBJECT})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        if not can_cancel(request.user, job):
            raise PermissionDenied("only the job's submitter or a manager of its project can cancel it")
        if job.is_final:
            how = f", exit {job.exit_code}" if job.exit_code is not None else ""
            raise AlreadyEnded(f"job {job.pk} already ended ({job.state}{how}); there is nothing to cancel")
        reason = str(request.data.get("reason", "")) if isinstance(request.data, dict) else ""
        job.cancel(request.user, reason or f"cancelled by {request.user}")
        job.refresh_from_db()
        return Response(JobSerializer(job).data)

    @extend_schema(request=None, responses={201: JobSerializer})
    @action(detail=True, methods=["post"])
    def resubmit(self, request, pk=None):
        """Submit the same job again (command, env, secrets, volumes, resources) as a new job.
        By another user than its submitter the secrets' values are not copied: give them as
        {"secret_env": {NAME: value}}; the resubmit is refused until every one is given."""
        job = self.get_object()
        given = request.data.get("secret_env") if isinstance(request.data, dict) else None
        spec = jobspec.copy_for(job, reproduce.clone_data(job), request.user, given)  # another user's: no secrets
        submit = JobSubmitSerializer(data=spec, context={"request": request, "copy_of": job})
        submit.is_valid(raise_exception=True)
        return Response(JobSerializer(submit.save(), context={"created": True}).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        responses=ResultSerializer,
        description="The job's result in one document: state, exit code, failure class, diagnosis, every "
        "metric's last and best value and step, the objective's value, the last 50 log lines and the first "
        "error, cost, and the seconds queued / in preflight / running (README: Agents).",
    )
    @action(detail=True, methods=["get"], pagination_class=None)
    def result(self, request, pk=None):
        return Response(results.result(self.get_object()))

    @extend_schema(
        parameters=[OpenApiParameter("a", int, required=True), OpenApiParameter("b", int, required=True)],
        responses=OpenApiTypes.OBJECT,
        description="Two jobs side by side: the spec fields that differ, every metric, the objective, the outcome.",
    )
    @action(detail=False, methods=["get"], pagination_class=None)
    def compare(self, request):
        a, b = (job_id_param(request, name) for name in ("a", "b"))
        jobs = Job.objects.visible_to(request.user).select_related("project", "environment")
        found = {job.pk: job for job in jobs.filter(pk__in=[a, b])}
        if a not in found or b not in found:
            raise NotFound(f"no job {a if a not in found else b} in your projects; check the id")
        return Response(results.comparison(found[a], found[b]))

    @extend_schema(responses=AttemptSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)
    def attempts(self, request, pk=None):
        job = self.get_object()
        return Response(AttemptSerializer(job.attempts.select_related("node"), many=True).data)

    @action(detail=True, methods=["post"])
    def move(self, request, pk=None):
        """Move a queued job up or down within its class: {"direction": "up" | "down"}."""
        job = self.get_object()
        direction = request.data.get("direction") if isinstance(request.data, dict) else None
        if direction not in ("up", "down"):
            raise serializers.ValidationError({"direction": "must be 'up' or 'down'"})
        movable = movable_jobs(request.user)
        if not movable.filter(pk=job.pk).exists():
            raise PermissionDenied("only the job's submitter or a manager of its project can move it")
        if job.state != JobState.QUEUED:
            raise serializers.ValidationError({"direction": f"job {job.pk} is {job.state}; only queued jobs move"})
        moved = job.move(request.user, direction, movable)
        return Response({"moved": moved, "job": JobSerializer(job).data})


def filter_jobs(jobs, params, user):
    if state := params.get("state"):
        if state not in JobState.values:
            raise serializers.ValidationError(
                {"state": f"{state!r} is not a job state; use one of {', '.join(JobState.values)}"}
            )
        jobs = jobs.filter(state=state)
    if project := params.get("project"):
        jobs = jobs.filter(project__slug=project)
    if who := params.get("submitted_by"):
        jobs = jobs.filter(submitted_by=user) if who == "me" else jobs.filter(submitted_by__username=who)
    if name := params.get("name"):
        jobs = jobs.filter(name__icontains=name)
    return jobs


def idempotency_key(request, data: dict) -> str:
    header = request.headers.get("Idempotency-Key", "").strip()
    field = str(data.get("idempotency_key") or "").strip()
    if header and field and header != field:
        raise serializers.ValidationError(
            {"idempotency_key": "differs from the Idempotency-Key header; send the key once, in either"}
        )
    key = header or field
    if len(key) > 200:
        raise serializers.ValidationError({"idempotency_key": f"is {len(key)} characters; use at most 200"})
    return key


def movable_jobs(user):
    """Jobs a user may reorder: their own in projects they submit to, and all of projects they manage."""
    members = Project.objects.with_role(user, Role.MEMBER)
    managed = Project.objects.with_role(user, Role.MANAGER)
    return Job.objects.filter(Q(project__in=managed) | Q(project__in=members, submitted_by=user))


def queue_state(user, project: str = "") -> dict:
    """The queue as `user` may see it: waiting jobs with position, reason and estimated
    start (positions count every job ahead, seen or not), and running jobs with placement."""
    visible = Job.objects.visible_to(user)
    if project:
        visible = visible.filter(project__slug=project)
    rows, _ = queue_report()
    jobs = visible.filter(pk__in=[r["job_id"] for r in rows]).select_related("project", "submitted_by", "environment")
    by_id = {j.pk: j for j in jobs}
    movable = set(movable_jobs(user).filter(pk__in=list(by_id)).values_list("pk", flat=True))
    waiting = [
        {**queue_job(by_id[r["job_id"]]), "position": r["position"], "reason": r["reason"],
         "estimated_start": r["estimated_start"], "can_move": r["job_id"] in movable}
        for r in rows
        if r["job_id"] in by_id
    ]  # fmt: skip
    # Blocked jobs wait for other jobs, not for GPUs: no position in the queue until they are queued.
    blocked = visible.filter(state=JobState.BLOCKED).select_related("project", "submitted_by", "environment")
    waiting += [
        {**queue_job(job), "position": None, "reason": {"code": "blocked", "message": job.state_reason},
         "estimated_start": None, "can_move": False}
        for job in blocked.order_by("created_at", "pk")[:BLOCKED_SHOWN]
    ]  # fmt: skip
    live = Attempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES, job__in=visible).select_related(
        "job__project", "job__submitted_by", "job__environment"
    )
    running = [
        {**queue_job(a.job), "state": a.state, "attempt": a.number, "placement": a.ranks,
         "borrowed": a.borrowed, "started_at": a.running_at or a.started_at,
         "preempting": a.preempt_requested_at is not None}
        for a in live.order_by("scheduled_at")
    ]  # fmt: skip
    return {"waiting": waiting, "running": running}


BLOCKED_SHOWN = 500


def queue_job(job: Job) -> dict:
    return {
        "id": job.pk,
        "name": job.name,
        "project": job.project.slug,
        "submitted_by": job.submitted_by.username,
        "priority": job.priority,
        "gpus_per_node": job.gpus_per_node,
        "nodes": job.nodes,
        "gpu_type": job.gpu_type,
        "environment": job.environment.name if job.environment else None,
        "queued_at": job.queued_at,
    }


class QueueView(APIView):
    """GET /api/v1/queue/?project=slug"""

    @extend_schema(parameters=[OpenApiParameter("project", str)], responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response(queue_state(request.user, request.query_params.get("project", "")))


class PriorityClassSerializer(serializers.Serializer):
    name = serializers.CharField()
    rank = serializers.IntegerField(help_text="Higher goes first.")
    may_preempt = serializers.BooleanField()
    preemptible = serializers.BooleanField()


class PriorityListView(APIView):
    """GET /api/v1/priorities/: the configured priority classes (HANGAR_PRIORITY_CLASSES), highest first."""

    @extend_schema(responses=PriorityClassSerializer(many=True))
    def get(self, request):
        return Response([asdict(c) for c in priority_classes().values()])


def can_cancel(user, job: Job) -> bool:
    """The same people who may reorder it: its submitter while a member, and the project's managers."""
    return movable_jobs(user).filter(pk=job.pk).exists()


def job_id_param(request, name: str) -> int:
    """A job id in the query; one that is no job's is answered 404 by the caller."""
    raw = request.query_params.get(name, "").strip()
    if not raw:
        raise serializers.ValidationError({name: "is required: give two job ids, e.g. ?a=12&b=15"})
    try:
        return int(raw[:20])
    except ValueError:
        raise serializers.ValidationError({name: f"{raw[:20]!r} is not a job id; give a number, e.g. 12"})


def int_param(request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    try:
        return whole_number(raw, name, maximum=2**31 - 1)
    except InputError as exc:
        raise serializers.ValidationError({exc.field: exc.message})
