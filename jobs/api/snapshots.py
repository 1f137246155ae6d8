"""The code snapshot API (jobs/snapshots.py says how a snapshot is checked and kept).

GET /api/v1/projects/<slug>/snapshots/<sha256>/   200 with its facts, or 404: upload it
PUT /api/v1/projects/<slug>/snapshots/<sha256>/   the tar.gz as the body (application/gzip)
GET /api/v1/jobs/<id>/code/                       the job's snapshot, a tar.gz
GET /api/v1/jobs/<id>/code/diff/                  the `git diff HEAD` kept with it, as text
"""

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import APIException, NotFound, PermissionDenied
from rest_framework.parsers import BaseParser
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import snapshots
from jobs.models import Job, Snapshot
from portal.capacity import slots
from portal.models import Project, Role

SHA256_PARAMETER = OpenApiParameter(
    "sha256", {"type": "string", "pattern": "^[0-9a-f]{64}$"}, OpenApiParameter.PATH, description="of the tar.gz"
)


class SnapshotSerializer(serializers.ModelSerializer):
    project = serializers.CharField(source="project.slug")

    class Meta:
        model = Snapshot
        fields = ["project", "sha256", "size", "unpacked_size", "files", "created_at", "last_referenced_at"]


class Refused(APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "invalid"

    def __init__(self, refused: snapshots.SnapshotRefused):
        super().__init__({refused.field: [refused.message]})
        self.status_code = refused.status
        self.default_code = {411: "length_required", 413: "too_large"}.get(refused.status, "invalid")


class TarballParser(BaseParser):
    """Lets a PUT say Content-Type: application/gzip; the view reads the body itself, as a stream."""

    media_type = "application/gzip"

    def parse(self, stream, media_type=None, parser_context=None):
        return {}


class OctetStreamParser(TarballParser):
    media_type = "application/octet-stream"


class SnapshotView(APIView):
    """Whether project <slug> has snapshot <sha256> (GET), and uploading it (PUT)."""

    parser_classes = [TarballParser, OctetStreamParser]

    @extend_schema(
        parameters=[SHA256_PARAMETER],
        responses={200: SnapshotSerializer, 400: OpenApiTypes.OBJECT, 404: OpenApiTypes.OBJECT},
    )
    def get(self, request, slug: str, sha256: str):
        project = get_object_or_404(Project.objects.visible_to(request.user), slug=slug)
        sha256 = checked(sha256)
        snapshot = Snapshot.objects.filter(project=project, sha256=sha256).select_related("project").first()
        if snapshot is None:
            raise NotFound(f"project {slug} has no snapshot {sha256}; upload it with PUT to this address")
        return Response(SnapshotSerializer(snapshot).data)

    @extend_schema(
        parameters=[SHA256_PARAMETER],
        request={"application/octet-stream": OpenApiTypes.BINARY},  # or application/gzip
        responses={
            200: SnapshotSerializer,
            201: SnapshotSerializer,
            400: OpenApiTypes.OBJECT,
            404: OpenApiTypes.OBJECT,
            411: OpenApiTypes.OBJECT,
            413: OpenApiTypes.OBJECT,
        },
    )
    def put(self, request, slug: str, sha256: str):
        """The tar.gz whose sha256 is <sha256>: 201 stored, 200 when the project had it already."""
        visible = Project.objects.visible_to(request.user).filter(slug=slug).exists()
        if not visible:
            raise NotFound(f"no project {slug} that you belong to")
        project = Project.objects.with_role(request.user, Role.MEMBER).filter(slug=slug).first()
        if project is None:
            raise PermissionDenied(f"uploading code to {slug} needs the member role; viewers may only read")
        length = request.META.get("CONTENT_LENGTH")
        try:
            length = int(length) if length not in (None, "") else None
            snapshot, created = snapshots.receive(project, checked(sha256), request.stream, length, request.user)
        except snapshots.SnapshotRefused as refused:
            raise Refused(refused)
        code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
        return Response(SnapshotSerializer(snapshot).data, status=code)


def checked(sha256: str) -> str:
    try:
        return snapshots.check_sha256(sha256)
    except snapshots.SnapshotRefused as refused:
        raise Refused(refused)


def job_snapshot(request, pk: int) -> tuple[Job, Snapshot | None]:
    job = get_object_or_404(Job.objects.visible_to(request.user).select_related("snapshot"), pk=pk)
    if not job.code:
        raise NotFound(f"job {pk} was submitted without code (hangar submit --code DIR)")
    return job, job.snapshot


class JobCodeView(APIView):
    """The tar.gz of the code job <id> ran (`hangar code ID` unpacks it)."""

    @extend_schema(
        responses={
            (200, "application/gzip"): OpenApiResponse(OpenApiTypes.BINARY),
            (404, "application/json"): OpenApiResponse(OpenApiTypes.OBJECT),
            (410, "application/json"): OpenApiResponse(OpenApiTypes.OBJECT),
        }
    )
    def get(self, request, pk: int):
        job, snapshot = job_snapshot(request, pk)
        if snapshot is None:
            raise Gone(
                f"job {pk}'s snapshot {job.code.get('snapshot')} was deleted: no job named it for "
                "HANGAR_SNAPSHOT_RETENTION_DAYS; its git commit and diff are still on the job"
            )
        chunks = snapshot.chunks()
        if isinstance(request._request, ASGIRequest):  # under ASGI a sync iterator would be read whole first
            chunks = async_chunks(chunks)
        response = StreamingHttpResponse(slots.hold_while("stream", request.user.pk, chunks))
        response["Content-Type"] = "application/gzip"
        response["Content-Length"] = str(snapshot.size)
        response["Content-Disposition"] = f'attachment; filename="job-{job.pk}-code.tar.gz"'
        response["X-Snapshot-Sha256"] = snapshot.sha256
        return response


class JobCodeDiffView(APIView):
    """The `git diff HEAD` of the dirty work tree job <id> was submitted from (empty when clean)."""

    @extend_schema(
        responses={
            (200, "text/plain"): OpenApiResponse(OpenApiTypes.STR),
            (404, "application/json"): OpenApiResponse(OpenApiTypes.OBJECT),
        }
    )
    def get(self, request, pk: int):
        job, _ = job_snapshot(request, pk)
        return HttpResponse(job.code_diff, content_type="text/plain; charset=utf-8")


class Gone(APIException):
    status_code = status.HTTP_410_GONE
    default_code = "gone"


async def async_chunks(chunks):
    done = object()
    while (chunk := await sync_to_async(next)(chunks, done)) is not done:
        yield chunk
