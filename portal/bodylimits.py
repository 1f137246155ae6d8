"""How big a request body may be, decided from its headers before any of it is read.

Django's DATA_UPLOAD_MAX_MEMORY_SIZE only applies when a view reads the body, and a
server in front of Django (portal.sync_http here) would have read and spooled all of
it by then: a 500 MB anonymous `POST /login/` went to disk before its 403. So the web
server checks Content-Length (and counts a body sent without one) against these limits
and answers 413 without reading on; BodyLimitMiddleware applies the same rule to a
request that reaches Django another way (another server, the test client).

A request with no credentials at all (no Authorization header, no session cookie) gets
the smaller anonymous limit: the login form and nothing else is posted anonymously. A
signed-in upload of a code snapshot (PUT /api/v1/projects/<slug>/snapshots/<sha256>/) gets
the snapshot limit instead (HANGAR_SNAPSHOT_MAX_MB, jobs/snapshots.py checks it exactly).
"""

import re
from collections.abc import Mapping

from django.conf import settings
from django.http import JsonResponse

UPLOAD_PATH = re.compile(r"^/api/v1/projects/[-\w]+/snapshots/[0-9a-f]{64}/$")
TAR_OVERHEAD = 1.1  # an upload may exceed its files' bytes by tar headers and padding


def limit_for(authorization: str, cookie: str, method: str = "", path: str = "") -> int:
    if authorization or f"{settings.SESSION_COOKIE_NAME}=" in cookie:
        if method == "PUT" and UPLOAD_PATH.match(path):
            return snapshot_upload_limit()
        return settings.HANGAR_MAX_BODY_BYTES
    return settings.HANGAR_MAX_ANONYMOUS_BODY_BYTES


def snapshot_upload_limit() -> int:
    """The largest body a snapshot upload may send: its files' limit plus tar's overhead."""
    return int(settings.HANGAR_SNAPSHOT_MAX_MB * 1024 * 1024 * TAR_OVERHEAD) + 1024 * 1024


def scope_limit(scope: dict) -> tuple[int, int | None, bool]:
    """An ASGI scope's (limit, declared Content-Length or None, declared length is invalid)."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope.get("headers", []):
        headers[name] = headers[name] + b"; " + value if name in headers else value
    text = {name: value.decode("latin-1") for name, value in headers.items()}
    credentials = text.get(b"authorization", ""), text.get(b"cookie", "")
    limit = limit_for(*credentials, scope.get("method", ""), scope.get("path", ""))
    declared, invalid = parse_length(text.get(b"content-length", ""))
    return limit, declared, invalid


def parse_length(raw: str) -> tuple[int | None, bool]:
    if not raw.strip():
        return None, False
    if not raw.strip().isdigit():
        return None, True
    return int(raw.strip()), False


def too_large(size: int | None, limit: int, anonymous: bool) -> JsonResponse:
    from portal.api.errors import error_body

    told = f"is {size} bytes" if size is not None else "is larger than that"
    who = " without signing in" if anonymous else ""
    message = f"request body {told}; at most {limit} bytes are accepted{who}"
    return JsonResponse(error_body("too_large", [{"field": "body", "message": message}]), status=413)


def bad_length() -> JsonResponse:
    from portal.api.errors import error_body

    message = "Content-Length is not a number of bytes"
    return JsonResponse(error_body("invalid", [{"field": "Content-Length", "message": message}]), status=400)


def is_anonymous_limit(limit: int) -> bool:
    return limit == settings.HANGAR_MAX_ANONYMOUS_BODY_BYTES != settings.HANGAR_MAX_BODY_BYTES


class BodyLimitMiddleware:
    """The same limits for a request that did not come through portal.sync_http."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        meta: Mapping = request.META
        limit = limit_for(meta.get("HTTP_AUTHORIZATION", ""), meta.get("HTTP_COOKIE", ""), request.method, request.path)
        declared, invalid = parse_length(str(meta.get("CONTENT_LENGTH") or ""))
        if invalid:
            return bad_length()
        if declared is not None and declared > limit:
            return too_large(declared, limit, is_anonymous_limit(limit))
        return self.get_response(request)
