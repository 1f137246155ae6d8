"""Who may keep a websocket open, checked at connect and again every few seconds.

A websocket outlives the request that opened it: a log stream kept sending for seconds
after its token was deleted. Each consumer re-checks its credentials every
HANGAR_WS_RECHECK_SECONDS and closes when they no longer hold:
- 4401: anonymous, or the token was revoked, the session ended (logout, a password
  change) or the user was deactivated;
- 4404: the user may no longer see what the socket shows (a job of a project they left);
- 4429: over the user's or the process's bound on open streams (portal.capacity).
A refused connection is accepted and then closed with its code: a close before the
accept reaches a browser or client as a bare HTTP 403, without the code.
"""

import asyncio
import logging
from importlib import import_module

from channels.db import database_sync_to_async
from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.utils.crypto import constant_time_compare

from portal.models import ApiToken

log = logging.getLogger("hangar.web")
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404
CLOSE_BUSY = 4429


async def refuse(consumer, code: int) -> None:
    await consumer.accept()
    await consumer.close(code=code)


def signed_in(scope: dict) -> bool:
    """The scope's token is still active, or its session still signs its user in; the user is active."""
    user = scope.get("user")
    if user is None or not user.is_authenticated:
        return False
    if token_id := scope.get("token_id"):
        return ApiToken.objects.active().filter(pk=token_id, user_id=user.pk, user__is_active=True).exists()
    session = scope.get("session")
    key = getattr(session, "session_key", None)
    if not key:
        return False
    fresh = import_module(settings.SESSION_ENGINE).SessionStore(key)  # re-read: a logout deletes it
    if str(fresh.get(SESSION_KEY)) != str(user.pk) or not fresh.get(BACKEND_SESSION_KEY):
        return False
    current = get_user_model().objects.filter(pk=user.pk, is_active=True).first()
    return current is not None and constant_time_compare(
        fresh.get(HASH_SESSION_KEY, ""), current.get_session_auth_hash()
    )


def watch(consumer, still_visible=None) -> asyncio.Task:
    """A task that closes `consumer` (4401, or 4404 when `still_visible()` turns false) once
    its credentials stop holding; cancel it on disconnect."""

    def code() -> int | None:
        if not signed_in(consumer.scope):
            return CLOSE_UNAUTHENTICATED
        if still_visible is not None and not still_visible():
            return CLOSE_NOT_FOUND
        return None

    async def run() -> None:
        check = database_sync_to_async(code)
        while True:
            await asyncio.sleep(settings.HANGAR_WS_RECHECK_SECONDS)
            try:
                closing = await check()
            except Exception:  # the database may be restarting: the next check decides
                log.warning("websocket re-check failed", exc_info=True)
                continue
            if closing is not None:
                log.info("websocket %s closed with %s: its access ended", consumer.scope.get("path"), closing)
                await consumer.close(code=closing)
                return

    return asyncio.create_task(run())
