"""One JSON error shape for the whole API.

    {"code": "invalid", "message": "command: ...", "errors": [{"field": "command", "message": "..."}]}

`message` is the first problem in a sentence an agent can act on; `errors`
lists every problem with the path of the field it concerns.
"""

import logging
import sys

from django.core.exceptions import PermissionDenied
from django.db import IntegrityError
from django.http import Http404, JsonResponse
from django.views.defaults import page_not_found, server_error
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from portal.api.shape import error_body, flatten
from portal.inputs import InputError
from portal.middleware import DATABASE_DOWN, database_unavailable
from portal.requestid import request_id_of

log = logging.getLogger("hangar.web")


def exception_handler(exc, context):
    if isinstance(exc, InputError):  # a bad value found past the parsers (portal.inputs): name its field
        exc = exceptions.ValidationError({exc.field: [exc.message]})
    if isinstance(exc, exceptions.ParseError):
        errors = [
            {
                "field": "body",
                "message": f"request body is not valid JSON ({exc.detail}); send one JSON object "
                "with the header Content-Type: application/json",
            }
        ]
        return Response(error_body("parse_error", errors), status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, IntegrityError):
        # Two writes raced past a uniqueness check (or a check is missing): say so, never a 500.
        message = "conflicts with an existing record (a name or key already in use); change it and retry"
        return Response(error_body("conflict", [{"field": "", "message": message}]), status=status.HTTP_409_CONFLICT)
    if isinstance(exc, DATABASE_DOWN):
        return database_unavailable(context["request"], exc)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound("not found, or not in a project you belong to")
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, exceptions.Throttled):
        wait = max(1, round(exc.wait or 1))
        exc = exceptions.Throttled(wait)
        # Set after construction: DRF would append its own "Expected available in ..." sentence.
        exc.detail = exceptions.ErrorDetail(
            f"rate limit of this API token exceeded; retry after {wait}s (see the Retry-After header)", "throttled"
        )
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        code = "invalid"
        errors = flatten(exc.detail)
    else:
        code = getattr(exc, "default_code", "error")
        detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
        errors = flatten(detail)
    response.data = error_body(code, errors)
    return response


def not_found(request, exception=None):
    """Django's 404 for URLs no view matched: JSON under /api/, the page elsewhere."""
    if request.path.startswith("/api/"):
        errors = [{"field": "", "message": f"no API endpoint at {request.path}; see /api/docs/ for the endpoints"}]
        return JsonResponse(error_body("not_found", errors), status=404)
    return page_not_found(request, exception)


def crashed(request):
    # Django calls this inside its except block: a database that went away while a
    # middleware read the session is an outage to retry, not a crash.
    if isinstance(error := sys.exc_info()[1], DATABASE_DOWN):
        return database_unavailable(request, error)
    # The traceback goes to Hangar's log under the request id the answer carries (portal.requestid).
    log.error("%s %s crashed (request id %s)", request.method, request.path, request_id_of(request), exc_info=True)
    if request.path.startswith("/api/"):
        errors = [{"field": "", "message": "internal error; the server log has the details, retry or report it"}]
        return JsonResponse(error_body("server_error", errors), status=500)
    return server_error(request)
