"""Bearer-token authentication, shared by the REST API and the websockets."""

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db.models.signals import post_delete, post_save
from rest_framework import authentication, exceptions

from portal.models import ApiToken, AuditEvent, hash_token

# An API client sends the same token request after request, and looking it up was one
# query of every request: checked tokens are kept in the process's local-memory cache,
# under a generation that forget_tokens() moves on (that cache cannot delete by prefix).
_generation = 0


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
    The local-memory cache hands every request its own unpickled copy of the token and user.
    """
    seconds = settings.HANGAR_API_TOKEN_CACHE_SECONDS
    if seconds <= 0:
        return ApiToken.authenticate(raw)
    key = f"api-token:{_generation}:{hash_token(raw)}"
    token = cache.get(key)
    if token is None and (token := ApiToken.authenticate(raw)) is not None:
        cache.set(key, token, seconds)
    return token


def forget_tokens(**kwargs) -> None:
    global _generation
    _generation += 1


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
                scope["token_id"] = token.pk  # re-checked while the socket is open (portal.wsauth)
        return await super().__call__(scope, receive, send)
