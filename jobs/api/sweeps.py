"""`/api/v1/sweeps/`: create a sweep from its file's content (JSON), list them, read one with
its runs ranked by objective (jobs/sweeps.py). The same file again returns the first sweep
(200, Idempotent-Replayed) and creates nothing, to a caller who may still see it (409 naming
nothing otherwise: jobs/submission.py held_by_key). A sweep whose token is revoked, or whose
submitter was deactivated or left the project, submits no more variants: `stopped_reason`."""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.response import Response

from jobs import sweeps
from jobs.models import Sweep
from portal.models import Project, Role


class SweepSummarySerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug")
    submitted_by = serializers.CharField(source="submitted_by.username")
    variants = serializers.IntegerField(source="size")

    class Meta:
        model = Sweep
        fields = ["id", "name", "project", "submitted_by", "objective", "max_parallel", "variants", "created_at"]


class SweepViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = SweepSummarySerializer
    queryset = Sweep.objects.none()
    lookup_value_regex = r"\d+"

    def get_queryset(self):
        found = Sweep.objects.visible_to(self.request.user).select_related("project", "submitted_by")
        if project := self.request.query_params.get("project"):
            found = found.filter(project__slug=project)
        return found

    @extend_schema(parameters=[OpenApiParameter("project", str)])
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses=OpenApiTypes.OBJECT, description="The sweep with its runs, best first, and its best run.")
    def retrieve(self, request, *args, **kwargs):
        return Response(sweeps.document(self.get_object()))

    @extend_schema(
        request=OpenApiTypes.OBJECT,
        responses={201: OpenApiTypes.OBJECT, 200: OpenApiTypes.OBJECT},
        description="A sweep file as JSON: name, project, base (a job spec), grid or variants, max_parallel, "
        "objective, optionally idempotency_key (default: a hash of the content). README: Agents.",
    )
    def create(self, request):
        sweep, created = sweeps.create(request.user, request.data)
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        headers = {} if created else {"Idempotent-Replayed": "true"}
        return Response(sweeps.document(sweep), status=code, headers=headers)

    @extend_schema(request=OpenApiTypes.OBJECT, responses=OpenApiTypes.OBJECT)
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Submit no more variants and cancel the unfinished ones: {"reason": "..."} optional."""
        sweep = self.get_object()
        managers = Project.objects.with_role(request.user, Role.MANAGER).filter(pk=sweep.project_id)
        member = Project.objects.with_role(request.user, Role.MEMBER).filter(pk=sweep.project_id)
        if not managers.exists() and not (sweep.submitted_by_id == request.user.pk and member.exists()):
            raise PermissionDenied("only the sweep's submitter or a manager of its project can cancel it")
        reason = request.data.get("reason") if isinstance(request.data, dict) else None
        cancelled = sweeps.cancel(sweep, request.user, str(reason or f"sweep cancelled by {request.user}"))
        sweep.refresh_from_db()
        return Response({**sweeps.document(sweep), "cancelled_jobs": cancelled})
