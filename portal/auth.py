"""Bearer-token authentication, shared by the REST API and the websockets."""

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from rest_framework import authentication, exceptions, permissions

from portal.models import ApiToken


def token_from_header(value: str) -> str | None:
    scheme, _, raw = value.partition(" ")
    if scheme.lower() in ("bearer", "token") and raw.strip():
        return raw.strip()
    return None


class ApiTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer hgr_...` (or `Token hgr_...`)."""

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        raw = token_from_header(header)
        if raw is None:
            raise exceptions.AuthenticationFailed(
                "Authorization header must be 'Bearer <token>'; create a token with `manage.py create_token USER`"
            )
        token = ApiToken.authenticate(raw)
        if token is None:
            raise exceptions.AuthenticationFailed("API token is unknown or revoked; create a new one")
        return (token.user, token)

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="api"'


class WebsocketTokenMiddleware(BaseMiddleware):
    """Authenticates a websocket by its Authorization header when it carries one.

    Runs inside AuthMiddlewareStack, so a browser's session cookie still works.
    """

    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", []))
        header = headers.get(b"authorization", b"").decode("latin-1")
        raw = token_from_header(header) if header else None
        if raw:
            token = await database_sync_to_async(ApiToken.authenticate)(raw)
            if token is not None:
                scope["user"] = token.user
        return await super().__call__(scope, receive, send)


class TokenScope(permissions.BasePermission):
    """A read-only token may only read. (Its project limit is applied by
    `Project.objects.visible_to`, which every queryset goes through.)"""

    message = "this API token is read-only; create a token without --read-only to submit, cancel or change things"

    def has_permission(self, request, view) -> bool:
        token = request.auth if isinstance(request.auth, ApiToken) else None
        return token is None or not token.read_only or request.method in permissions.SAFE_METHODS
