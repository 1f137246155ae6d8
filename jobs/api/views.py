from django.db.models import Q
from django.shortcuts import get_object_or_404
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.api.serializers import JobSerializer, JobSubmitSerializer
from jobs.messages import wire_lines
from jobs.models import ACTIVE_ATTEMPT_STATES, Attempt, Job, JobState, LogLine
from jobs.scheduler import queue_report
from portal.models import Project, Role

LOG_PAGE_MAX = 5000


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = JobSerializer

    def get_queryset(self):
        jobs = Job.objects.visible_to(self.request.user).select_related("project", "submitted_by")
        if state := self.request.query_params.get("state"):
            jobs = jobs.filter(state=state)
        if project := self.request.query_params.get("project"):
            jobs = jobs.filter(project__slug=project)
        return jobs.prefetch_related("attempts__node")

    def create(self, request):
        submit = JobSubmitSerializer(data=request.data, context={"request": request})
        submit.is_valid(raise_exception=True)
        job = submit.save()
        return Response(JobSerializer(job).data, status=status.HTTP_201_CREATED)

    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        job = self.get_object()
        if not can_cancel(request.user, job):
            raise PermissionDenied("only the job's submitter or a manager of its project can cancel it")
        reason = str(request.data.get("reason", "")) if isinstance(request.data, dict) else ""
        job.cancel(request.user, reason or f"cancelled by {request.user}")
        job.refresh_from_db()
        return Response(JobSerializer(job).data)

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

    @action(detail=True, methods=["get"])
    def logs(self, request, pk=None):
        """Stored lines after a cursor: ?after_attempt=ID&after_seq=N&limit=M."""
        job = get_object_or_404(self.get_queryset(), pk=pk)
        after_attempt = int_param(request, "after_attempt", 0)
        after_seq = int_param(request, "after_seq", 0)
        limit = min(int_param(request, "limit", 1000), LOG_PAGE_MAX)
        lines = list(LogLine.after(job.pk, after_attempt, after_seq)[:limit])
        cursor = (
            {"attempt": lines[-1].attempt_id, "seq": lines[-1].seq}
            if lines
            else {"attempt": after_attempt, "seq": after_seq}
        )
        return Response({"lines": wire_lines(lines), "cursor": cursor, "job_state": job.state})


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

    def get(self, request):
        return Response(queue_state(request.user, request.query_params.get("project", "")))


def can_cancel(user, job: Job) -> bool:
    if (
        job.submitted_by_id == user.pk
        and Project.objects.with_role(user, Role.MEMBER).filter(pk=job.project_id).exists()
    ):
        return True
    return Project.objects.with_role(user, Role.MANAGER).filter(pk=job.project_id).exists()


def int_param(request, name: str, default: int) -> int:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise serializers.ValidationError({name: f"must be a whole number, got {raw!r}"})
    if value < 0:
        raise serializers.ValidationError({name: "must not be negative"})
    return value
