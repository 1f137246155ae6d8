"""Who may keep a live connection open: checked at connect, again every few seconds, and at
once when a credential ends.

A websocket outlives the request that opened it: a log stream kept sending for seconds
after its token was deleted. Each consumer re-checks its credentials every
HANGAR_WS_RECHECK_SECONDS and closes when they no longer hold:
- 4401: anonymous, or the token was revoked, the session ended (logout, a password
  change) or the user was deactivated;
- 4404: the user may no longer see what the socket shows (a job of a project they left);
- 4429: over the user's or the process's bound on open streams (portal.capacity).
A refused connection is accepted and then closed with its code: a close before the
accept reaches a browser or client as a bare HTTP 403, without the code.

The end of a credential does not wait for that re-check: a revocation, a deactivation, a
change of a user's memberships or password, or a logout tells the sockets it concerns after
its commit (`credentials_ended`). A socket of the revoked token (or the ended session)
closes with 4401 at once; a socket of the changed user looks again now. The news travels
to a group per token and per user that each socket joins on the channel layer (services
mode: every web process), or, with no layer (the embedded default, one web process),
through this process's own list of open sockets. The periodic re-check stays for what no
signal tells: a session that expires, a change made by another process without a layer.

A long poll (jobs/api/logs.py) reads `still_signed_in` with the job's state between waits, and
a log socket asks `scope_acts` after each read of lines and before sending them
(jobs/consumers.py): no line read after a revocation committed goes out, whichever web
process made it, even before the news reaches the socket's.
"""

import asyncio
import contextlib
import hashlib
import logging
import threading
from collections import defaultdict
from datetime import datetime
from importlib import import_module
from typing import Literal, TypedDict

from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.contrib.auth.signals import user_logged_out
from django.contrib.sessions.models import Session
from django.db import transaction
from django.db.models import Exists
from django.db.models.signals import post_delete, post_save
from django.utils import timezone
from django.utils.crypto import constant_time_compare

from portal import statements
from portal.models import ApiToken, AuditEvent, Membership

log = logging.getLogger("hangar.web")
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404
CLOSE_BUSY = 4429
TOKEN_GROUP = "hangar.token.{}"
USER_GROUP = "hangar.user.{}"
# Session engines whose sessions are rows a long poll can look for in its own query.
DATABASE_SESSIONS = ("django.contrib.sessions.backends.db", "django.contrib.sessions.backends.cached_db")


class CredentialsEnded(TypedDict):
    """What a socket's group is sent when one of its credentials ends."""

    type: Literal["credentials.ended"]
    closing: bool  # the token ended: close without a look; False: the user changed, look again
    session: str  # a logout: the ended session's digest (a socket of it closes), else ""


async def refuse(consumer, code: int) -> None:
    await consumer.accept()
    await consumer.close(code=code)


def signed_in(scope: dict) -> bool:
    """The scope's token is still active, or its session still signs its user in; the user is active."""
    user = scope.get("user")
    if user is None or not user.is_authenticated:
        return False
    if token_id := scope.get("token_id"):
        return token_acts.first(pk=token_id, user_id=user.pk) is not None
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


def still_signed_in(user_id: int, token_id: int | None, session_key: str | None) -> list[Exists]:
    """Conditions that hold while a connection's credentials do (its token active and its user
    active, or its session alive and its user active), for a query it makes anyway: a long
    poll's read of the job's state between waits."""
    if token_id:
        return [Exists(ApiToken.objects.active().filter(pk=token_id, user_id=user_id, user__is_active=True))]
    conditions = [Exists(get_user_model().objects.filter(pk=user_id, is_active=True))]
    if session_key and settings.SESSION_ENGINE in DATABASE_SESSIONS:
        conditions.append(Exists(Session.objects.filter(session_key=session_key, expire_date__gt=timezone.now())))
    return conditions


@statements.query
def token_acts(pk: int, user_id: int):
    """The token, while it is active and its user too (a log socket asks before each batch it sends)."""
    return ApiToken.objects.active().filter(pk=pk, user_id=user_id, user__is_active=True).values_list("pk")[:1]


@statements.query
def session_acts(session_key: str, user_id: int, now: datetime):
    """The user, while active and signed in by this (database) session."""
    alive = Session.objects.filter(session_key=session_key, expire_date__gt=now)
    return get_user_model().objects.filter(Exists(alive), pk=user_id, is_active=True).values_list("pk")[:1]


def scope_acts(scope: dict) -> bool:
    """Whether a websocket's token, or its session, still signs its user in: one compiled statement,
    cheap enough for a log socket to ask before each batch of lines it sends."""
    user_id = scope["user"].pk
    if token_id := scope.get("token_id"):
        return token_acts.first(pk=token_id, user_id=user_id) is not None
    key = getattr(scope.get("session"), "session_key", None)
    if not key or settings.SESSION_ENGINE not in DATABASE_SESSIONS:
        return signed_in(scope)
    return session_acts.first(session_key=key, user_id=user_id, now=timezone.now()) is not None


def session_digest(key: str | None) -> str:
    """A session key as its group messages name it (the key itself never travels)."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


# --- open sockets, told when a credential ends -------------------------------------------


def groups_of(scope: dict) -> list[str]:
    groups = [USER_GROUP.format(scope["user"].pk)]
    if token_id := scope.get("token_id"):
        groups.append(TOKEN_GROUP.format(token_id))
    return groups


class Watch:
    """One open socket's watch: woken by news for its groups, or by its re-check timer."""

    def __init__(self, scope: dict):
        self.groups = groups_of(scope)
        # A token's socket ends with its token, not with a browser session it happened to carry.
        key = None if scope.get("token_id") else getattr(scope.get("session"), "session_key", None)
        self.session = session_digest(key)
        self.loop = asyncio.get_running_loop()
        self.woken = asyncio.Event()
        self.ended = False  # its token or session ended: close without a look

    def tell(self, message: CredentialsEnded) -> None:
        """From any thread."""
        with contextlib.suppress(RuntimeError):  # its event loop has closed: nothing left to close
            self.loop.call_soon_threadsafe(self.told, message)

    def told(self, message: CredentialsEnded) -> None:
        mine = bool(self.session) and constant_time_compare(message.get("session") or "", self.session)
        self.ended = self.ended or bool(message.get("closing")) or mine
        self.woken.set()

    async def wait(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.woken.wait(), seconds)
        self.woken.clear()


class LocalSockets:
    """This process's open sockets by group: how news reaches them when there is no layer."""

    def __init__(self):
        self.lock = threading.Lock()  # told from request threads, changed on the event loop
        self.by_group: dict[str, set[Watch]] = defaultdict(set)

    def add(self, watch: Watch) -> None:
        with self.lock:
            for group in watch.groups:
                self.by_group[group].add(watch)

    def remove(self, watch: Watch) -> None:
        with self.lock:
            for group in watch.groups:
                members = self.by_group.get(group, set())
                members.discard(watch)
                if not members:
                    self.by_group.pop(group, None)

    def tell(self, group: str, message: CredentialsEnded) -> int:
        with self.lock:
            members = list(self.by_group.get(group, ()))
        for watch in members:
            watch.tell(message)
        return len(members)


local_sockets = LocalSockets()


async def listen(layer, watch: Watch) -> None:
    """Join the watch's groups on the layer with a channel of its own, and pass on what they are sent.
    (Its own channel, not the consumer's: a consumer has no handler for this message.)"""
    channel = await layer.new_channel()
    try:
        for group in watch.groups:
            await layer.group_add(group, channel)
        while True:
            message = await layer.receive(channel)
            if message.get("type") == "credentials.ended":
                watch.told(message)
    except Exception:  # the layer failed: the periodic re-check still closes the socket
        log.warning("websocket: news of ended credentials cannot be received", exc_info=True)
    finally:
        with contextlib.suppress(Exception):  # the layer may be down: its groups expire by themselves
            for group in watch.groups:
                await layer.group_discard(group, channel)


def watch(consumer, still_visible=None, before_close=None) -> asyncio.Task:
    """A task that closes `consumer` (4401, or 4404 when `still_visible()` turns false) once
    its credentials stop holding; cancel it on disconnect. `before_close`: a coroutine
    function run first (a stream stops sending before the close goes out)."""
    watching = Watch(consumer.scope)
    layer = get_channel_layer()

    def code() -> int | None:
        if not signed_in(consumer.scope):
            return CLOSE_UNAUTHENTICATED
        if still_visible is not None and not still_visible():
            return CLOSE_NOT_FOUND
        return None

    async def closing_code() -> int | None:
        await watching.wait(settings.HANGAR_WS_RECHECK_SECONDS)
        if watching.ended:
            return CLOSE_UNAUTHENTICATED
        try:
            return await database_sync_to_async(code)()
        except Exception:  # the database may be restarting: the next check decides
            log.warning("websocket re-check failed", exc_info=True)
            return None

    async def run() -> None:
        listener = asyncio.create_task(listen(layer, watching)) if layer is not None else None
        try:
            while (closing := await closing_code()) is None:
                pass
            log.info("websocket %s closed with %s: its access ended", consumer.scope.get("path"), closing)
            if before_close is not None:
                await before_close()
            await consumer.close(code=closing)
        finally:
            if listener is not None:
                listener.cancel()

    task = asyncio.create_task(run())
    if layer is None:
        local_sockets.add(watching)  # now: news sent after this line reaches it
        # A done callback, not run()'s `finally`: a task cancelled before its first step never runs that.
        task.add_done_callback(lambda _: local_sockets.remove(watching))
    return task


# --- telling them -----------------------------------------------------------------------


def credentials_ended(token_id: int | None = None, user_id: int | None = None, session_key: str = "") -> None:
    """After the current transaction commits, tell the open sockets of this token (they close)
    and of this user (they look again; those of `session_key` close)."""
    news: list[tuple[str, CredentialsEnded]] = []
    if token_id:
        closed: CredentialsEnded = {"type": "credentials.ended", "closing": True, "session": ""}
        news.append((TOKEN_GROUP.format(token_id), closed))
    if user_id:
        session = session_digest(session_key)
        changed: CredentialsEnded = {"type": "credentials.ended", "closing": False, "session": session}
        news.append((USER_GROUP.format(user_id), changed))
    if news:
        transaction.on_commit(lambda: tell(news))


def tell(news: list[tuple[str, CredentialsEnded]]) -> None:
    layer = get_channel_layer()
    if layer is None:
        for group, message in news:
            local_sockets.tell(group, message)
        return
    try:
        async_to_sync(send_all)(layer, news)
    except Exception:  # the sockets still close at their next re-check
        log.warning("open websockets were not told that a credential ended", exc_info=True)


async def send_all(layer, news: list[tuple[str, CredentialsEnded]]) -> None:
    for group, message in news:
        await layer.group_send(group, message)


def _token_revoked(sender, instance: AuditEvent, created: bool = False, **kwargs) -> None:
    # ApiToken.revoke is a conditional update (no save signal); its audit row is the signal.
    if created and instance.action == "token.revoke":
        credentials_ended(token_id=int(instance.target_id))


def _token_deleted(sender, instance: ApiToken, **kwargs) -> None:
    credentials_ended(token_id=instance.pk)


def _user_changed(sender, instance, created: bool = False, update_fields=None, **kwargs) -> None:
    # A new user has no socket; a login elsewhere (last_login) changes nothing for the open ones.
    if created or (update_fields is not None and set(update_fields) <= {"last_login"}):
        return
    credentials_ended(user_id=instance.pk)


def _membership_changed(sender, instance: Membership, created: bool = False, **kwargs) -> None:
    if not created:  # a new membership takes nothing away
        credentials_ended(user_id=instance.user_id)


def _logged_out(sender, request=None, user=None, **kwargs) -> None:
    if user is not None:
        session = getattr(request, "session", None)
        credentials_ended(user_id=user.pk, session_key=getattr(session, "session_key", None) or "")


post_save.connect(_token_revoked, sender=AuditEvent, dispatch_uid="hangar.wsauth.token_revoked")
post_delete.connect(_token_deleted, sender=ApiToken, dispatch_uid="hangar.wsauth.token_deleted")
post_save.connect(_user_changed, sender=get_user_model(), dispatch_uid="hangar.wsauth.user_saved")
post_delete.connect(_user_changed, sender=get_user_model(), dispatch_uid="hangar.wsauth.user_deleted")
post_save.connect(_membership_changed, sender=Membership, dispatch_uid="hangar.wsauth.membership_saved")
post_delete.connect(_membership_changed, sender=Membership, dispatch_uid="hangar.wsauth.membership_deleted")
user_logged_out.connect(_logged_out, dispatch_uid="hangar.wsauth.logged_out")
