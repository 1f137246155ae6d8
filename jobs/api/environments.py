"""Environments over the API: `GET /api/v1/environments/` lists them, and an operator's
`POST /api/v1/environments/<name>/rebuild/` drops what every node cached for one (or the
cached environment whose hash starts with <name>), so the next job that asks builds it anew."""

import re

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from jobs.models import Environment, EnvironmentRebuild

HASH_PREFIX = re.compile(r"^[0-9a-f]{8,64}$")


class EnvironmentSerializer(serializers.ModelSerializer):
    class Meta:
        model = Environment
        fields = ["name", "description", "kind", "path", "image", "requirements", "python_version", "everywhere"]


class EnvironmentViewSet(viewsets.ReadOnlyModelViewSet):
    """Environments are shared by all projects: any signed-in user reads them; operators (staff) rebuild."""

    serializer_class = EnvironmentSerializer
    queryset = Environment.objects.all()
    lookup_field = "name"
    lookup_value_regex = "[^/]+"
    operator_actions = ("rebuild",)  # portal.permissions.ApiAccess: staff, never a project-limited token

    @extend_schema(
        request=None,
        responses=OpenApiTypes.OBJECT,
        description="Every node drops the environments it cached for this named environment (or the one whose "
        "hash starts with it, 8+ hex digits, as node pages show it) within 30 s; one a running job "
        "holds goes when that job ends. The next job that asks for it builds it anew.",
    )
    @action(detail=True, methods=["post"])
    def rebuild(self, request, name=None):
        if not Environment.objects.filter(name=name).exists() and not HASH_PREFIX.match(name):
            raise ValidationError(
                {"name": [f"{name!r} is neither an environment nor a cached environment's hash (8+ hex digits)"]}
            )
        rebuild = EnvironmentRebuild.objects.create(target=name, requested_by=request.user)
        body = {
            "target": name,
            "requested_at": rebuild.requested_at,
            "message": f"every node drops its cached {name} environments within 30 s",
        }
        return Response(body, status=status.HTTP_202_ACCEPTED)
