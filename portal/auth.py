"""Bearer-token authentication, shared by the REST API and the websockets."""

import copy
import threading
from time import monotonic

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models.signals import post_delete, post_save
from rest_framework import authentication, exceptions, permissions

from portal.models import ApiToken, AuditEvent, hash_token

# digest -> (monotonic expiry, token with its user): an API client sends the same token
# request after request, and looking it up was one query of every request.
_recent: dict[str, tuple[float, ApiToken]] = {}
_recent_lock = threading.Lock()
RECENT_TOKENS_MAX = 10_000


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
        token = recent_token(raw)
        if token is None:
            raise exceptions.AuthenticationFailed("API token is unknown or revoked; create a new one")
        return (token.user, token)

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="api"'


def recent_token(raw: str) -> ApiToken | None:
    """`ApiToken.authenticate`, remembered by this process for HANGAR_API_TOKEN_CACHE_SECONDS.

    So a revoked token, a deactivated user or a changed token limit takes effect at once in
    this process (the saves and the revocation's audit row below forget every token) and
    within that many seconds in the other web processes. Unknown tokens are never remembered.
    """
    seconds = settings.HANGAR_API_TOKEN_CACHE_SECONDS
    if seconds <= 0:
        return ApiToken.authenticate(raw)
    digest, now = hash_token(raw), monotonic()
    hit = _recent.get(digest)
    if hit is not None and hit[0] > now:
        token = hit[1]
    else:
        token = ApiToken.authenticate(raw)
        with _recent_lock:
            if token is None:
                _recent.pop(digest, None)
                return None
            if len(_recent) >= RECENT_TOKENS_MAX:
                _recent.clear()
            _recent[digest] = (now + seconds, token)
    # Each request gets its own copies: nothing one request sets on its user reaches the next.
    mine = copy.copy(token)
    mine.user = copy.copy(token.user)
    return mine


def forget_tokens(**kwargs) -> None:
    with _recent_lock:
        _recent.clear()


def forget_tokens_on_revoke(sender, instance: AuditEvent, created: bool = False, **kwargs) -> None:
    # ApiToken.revoke is a conditional update (no save signal); its audit row is the signal.
    if instance.action == "token.revoke":
        forget_tokens()


post_save.connect(forget_tokens, sender=ApiToken, dispatch_uid="hangar.forget_tokens.token_saved")
post_delete.connect(forget_tokens, sender=ApiToken, dispatch_uid="hangar.forget_tokens.token_deleted")
post_save.connect(forget_tokens, sender=get_user_model(), dispatch_uid="hangar.forget_tokens.user_saved")
post_delete.connect(forget_tokens, sender=get_user_model(), dispatch_uid="hangar.forget_tokens.user_deleted")
post_save.connect(forget_tokens_on_revoke, sender=AuditEvent, dispatch_uid="hangar.forget_tokens.revoked")


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
