from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from jobs.api.serializers import JobSerializer, JobSubmitSerializer
from jobs.models import Job
from portal.models import Project, Role


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
