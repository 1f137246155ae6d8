"""What an API token's jobs use against its limits: `GET /api/v1/tokens/<id>/usage/`, or
`/api/v1/tokens/current/usage/` for the token of the request (an agent reading its own)."""

from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import tokenlimits
from portal.models import ApiToken


def usage_document(token: ApiToken) -> dict:
    limits = {name: (str(value) if value is not None else None) for name, value in token.limits.items()}
    return {"token": token.pk, "name": token.name, "limits": limits, "used": tokenlimits.usage(token).as_dict()}


class TokenUsageView(APIView):
    @extend_schema(
        responses=OpenApiTypes.OBJECT,
        description="The token's limits and what its jobs use: unfinished jobs, their GPUs, today's GPU-hours "
        "and spend (UTC day).",
    )
    def get(self, request, pk: int):
        return Response(usage_document(get_object_or_404(ApiToken, pk=pk, user=request.user)))


class CurrentTokenUsageView(APIView):
    @extend_schema(responses=OpenApiTypes.OBJECT, description="The usage of the token this request is made with.")
    def get(self, request):
        if not isinstance(request.auth, ApiToken):
            raise NotFound("this request carries no API token; send Authorization: Bearer <token>")
        return Response(usage_document(request.auth))
