"""The job log websocket: /ws/jobs/<id>/logs/?after_attempt=A&after_seq=S&<filters>

A client subscribes with filters and a resume cursor: in the query string at
connect, and at any time after with a message
`{"type": "subscribe", "filters": {...}, "cursor": {"attempt": A, "seq": S}}`
that replaces the running subscription. Every message of a subscription
carries its number `sub`, so a client can drop batches of one it replaced.

Lines are always read from the database after the subscription's cursor, with
its filters applied there; a hint from the channel layer (services mode) or a
short poll (embedded mode) says when to read again. A reconnecting client
passes its last cursor and gets exactly the matching lines after it.
"""

import asyncio
import json
import logging
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db.models import OuterRef, Subquery

from jobs.logquery import LogFilter, LogFilterError, first_error, read_page, wire_lines
from jobs.messages import (
    Cursor,
    ErrorMessage,
    FirstErrorMessage,
    LogAppendedHint,
    StateMessage,
    SubscribedMessage,
    job_group,
    telemetry_url,
)
from jobs.models import FINAL_JOB_STATES, Attempt, Job
from portal import wsauth
from portal.capacity import slots

log = logging.getLogger("hangar.web")
# A subscription's first batch is small, so the view fills at once; a replay then goes on in
# bigger ones (over PostgreSQL here: 18,000 lines/s in batches of 1,000, 28,000 in 5,000).
FIRST_BATCH, BATCH = 1000, 5000
# No message is larger than this (README: Logs, the websocket protocol): a batch of long lines
# goes out in several messages, each with the cursor of its own last line. (Clients' default
# limits are often 1 MiB; websockets' is, and a larger message is closed with 1009.)
MAX_MESSAGE_BYTES = 512 * 1024
CLOSE_UNAUTHENTICATED = wsauth.CLOSE_UNAUTHENTICATED
CLOSE_NOT_FOUND = wsauth.CLOSE_NOT_FOUND


class AccessEnded(Exception):
    """A read found the socket's token or session no longer signs its user in (closed with 4401)."""


class JobLogConsumer(AsyncWebsocketConsumer):
    close_sent = False

    async def connect(self):
        # Refusals are accepted, then closed with their code (portal.wsauth).
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await wsauth.refuse(self, CLOSE_UNAUTHENTICATED)
            return
        self.job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        if not await database_sync_to_async(self.visible)():
            await wsauth.refuse(self, CLOSE_NOT_FOUND)
            return
        if (refusal := slots.take("stream", user.pk)) is not None:
            log.info("log stream of job %s refused: %s", self.job_id, refusal)
            await wsauth.refuse(self, wsauth.CLOSE_BUSY)
            return
        self.slot = user.pk
        self.wake = asyncio.Event()
        self.sub = 0
        self.pump: asyncio.Task | None = None
        self.ended = False
        if self.channel_layer is not None:
            await self.channel_layer.group_add(job_group(self.job_id), self.channel_name)
        await self.accept()
        self.watcher = wsauth.watch(self, self.visible, before_close=self.end_access)
        params = {k: v[-1] for k, v in parse_qs(self.scope.get("query_string", b"").decode("latin-1")).items()}
        await self.subscribe(params, cursor_from(params), announce=False)

    def visible(self) -> bool:
        return Job.objects.visible_to(self.scope["user"]).filter(pk=self.job_id).exists()

    async def close(self, code=None, reason=None):
        """Once: the stream and the watch may both end it."""
        if not self.close_sent:
            self.close_sent = True
            await super().close(code=code, reason=reason)

    async def disconnect(self, code):
        if getattr(self, "pump", None) is not None:
            self.pump.cancel()
        if getattr(self, "watcher", None) is not None:
            self.watcher.cancel()
        if getattr(self, "slot", None) is not None:
            slots.give_back("stream", self.slot)
            self.slot = None
        if self.channel_layer is not None and hasattr(self, "job_id"):
            await self.channel_layer.group_discard(job_group(self.job_id), self.channel_name)

    async def end_access(self) -> None:
        """Its access ended (portal.wsauth closes it next): no line goes out after this, even
        to a subscribe that arrives before the close does."""
        self.ended = True
        await self.stop_streaming()

    async def stop_streaming(self) -> None:
        if self.pump is not None:
            self.pump.cancel()
            await asyncio.gather(self.pump, return_exceptions=True)
            self.pump = None

    async def receive(self, text_data=None, bytes_data=None):
        try:
            message = json.loads(text_data or "")
        except ValueError:
            message = None
        if not isinstance(message, dict) or message.get("type") != "subscribe":
            await self.send_json({"type": "error", "field": "type", "message": 'send {"type": "subscribe", ...}'})
            return
        filters = message.get("filters") or {}
        cursor = message.get("cursor") or {}
        if not isinstance(filters, dict) or not isinstance(cursor, dict):
            await self.send_json({"type": "error", "field": "filters", "message": "filters and cursor are objects"})
            return
        await self.subscribe(filters, cursor_from({f"after_{k}": v for k, v in cursor.items()}))

    async def subscribe(self, filters: dict, cursor: Cursor, announce: bool = True) -> None:
        """Stop the running subscription and start one with these filters from this cursor."""
        await self.stop_streaming()
        if self.ended:  # its access ended: the close is on its way
            return
        try:
            log_filter = LogFilter.parse(filters)
        except LogFilterError as exc:
            error: ErrorMessage = {"type": "error", "field": exc.field, "message": exc.message}
            await self.send_json(error)
            return
        self.sub += 1
        if announce:
            subscribed: SubscribedMessage = {
                "type": "subscribed",
                "sub": self.sub,
                "filters": log_filter.as_dict(),
                "cursor": cursor,
            }
            await self.send_json(subscribed)
        self.pump = asyncio.create_task(self.stream(Subscription(self.sub, log_filter, cursor)))

    async def log_appended(self, message: LogAppendedHint):
        self.wake.set()

    async def stream(self, subscription: "Subscription"):
        try:
            await self.follow(subscription)
        except asyncio.CancelledError:
            raise
        except AccessEnded:
            log.info("log stream of job %s closed with %s: its access ended", self.job_id, CLOSE_UNAUTHENTICATED)
            self.ended = True
            await self.close(code=CLOSE_UNAUTHENTICATED)
        except LogFilterError as exc:  # PostgreSQL refused the pattern RE2 accepted
            error: ErrorMessage = {"type": "error", "field": exc.field, "message": exc.message}
            await self.send_json(error)
        except OSError as exc:
            # The viewer went away mid-send (uvicorn's ClientDisconnected is an OSError):
            # routine for a client that reconnects from its cursor, not a failure to log.
            log.info("log stream of job %s: viewer disconnected (%s)", self.job_id, type(exc).__name__)
        except Exception:
            log.exception("log stream of job %s failed", self.job_id)
            await self.close(code=1011)  # the client reconnects from its cursor

    async def follow(self, sub: "Subscription"):
        """Send every matching stored line after the cursor, then the state; repeat on each hint or poll."""
        last_state = None
        while True:
            self.wake.clear()
            lines, cursor, more, state, errors = await self.read(sub)
            moved = cursor != (sub.cursor["attempt"], sub.cursor["seq"])
            sub.cursor = {"attempt": cursor[0], "seq": cursor[1]}
            if lines or moved:
                for text in lines_messages(sub.number, lines, sub.cursor):
                    await self.send(text_data=text)
            for line in errors:
                found: FirstErrorMessage = {
                    "type": "first_error",
                    "sub": sub.number,
                    "line": line,
                    "telemetry_url": telemetry_url(line),
                }
                await self.send_json(found)
            if more:
                continue
            if state != last_state:
                last_state = state
                final = state[0] in FINAL_JOB_STATES
                await self.send_state(state, final=final)
                if final:
                    return
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=settings.HANGAR_LOG_POLL_SECONDS)
            except TimeoutError:
                pass

    @database_sync_to_async
    def read(self, sub: "Subscription"):
        # The state is read before the lines: a final state seen here means
        # every line was stored before it, so none can come after "final".
        job_state, exit_code, attempt_state = (
            Job.objects.filter(pk=self.job_id).values_list("state", "exit_code", Subquery(LATEST_ATTEMPT_STATE)).get()
        )
        before = (sub.cursor["attempt"], sub.cursor["seq"])
        lines, cursor, more = read_page(self.job_id, sub.filter, before, BATCH if sub.read_any else FIRST_BATCH)
        if lines and not wsauth.scope_acts(self.scope):  # after the read: none read after a revocation goes out
            raise AccessEnded
        sub.read_any = True
        errors = []
        while cursor != before and (line := first_error(self.job_id, sub.errors_sent)) is not None:
            if (line.attempt_id, line.seq) > cursor:
                break  # not reached yet: announce it with the batch that holds it
            sub.errors_sent.add(line.attempt_id)
            errors.extend(wire_lines([line]))
        state = (job_state, attempt_state, exit_code)
        return wire_lines(lines, sub.filter.pattern()), cursor, more, state, errors

    async def send_state(self, state, final: bool):
        job_state, attempt_state, exit_code = state
        message: StateMessage = {
            "type": "state",
            "state": job_state,
            "attempt_state": attempt_state,
            "exit_code": exit_code,
            "final": final,
        }
        await self.send_json(message)

    async def send_json(self, message) -> None:
        await self.send(text_data=json.dumps(message))


# The state of a job's newest attempt, read in the same query as the job's (one query a poll).
LATEST_ATTEMPT_STATE = Attempt.objects.filter(job=OuterRef("pk")).order_by("-number").values("state")[:1]


def lines_messages(sub: int, lines: list, cursor: Cursor, limit: int = MAX_MESSAGE_BYTES) -> list[str]:
    """A batch as LinesMessage texts of at most `limit` bytes each (a single line longer than
    that still goes, alone: lines are capped at ingest far below it). Every message but the last
    carries its last line's cursor, the last one the batch's, so a client that drops between
    two messages resumes exactly after what it received."""

    def message(encoded: list[str], at: Cursor) -> str:
        return f'{{"type": "lines", "sub": {sub}, "lines": [{", ".join(encoded)}], "cursor": {json.dumps(at)}}}'

    overhead = len(message([], cursor).encode()) + 64
    texts, chunk, size, last = [], [], overhead, cursor
    for line in lines:
        encoded = json.dumps(line)
        weight = len(encoded.encode()) + 2
        if chunk and size + weight > limit:
            texts.append(message(chunk, last))
            chunk, size = [], overhead
        chunk.append(encoded)
        size += weight
        last = {"attempt": line["attempt"], "seq": line["seq"]}
    texts.append(message(chunk, cursor))
    return texts


class Subscription:
    def __init__(self, number: int, log_filter: LogFilter, cursor: Cursor):
        self.number = number
        self.filter = log_filter
        self.cursor = cursor
        self.errors_sent: set[int] = set()
        self.read_any = False


def cursor_from(params: dict) -> Cursor:
    def number(name: str) -> int:
        try:
            return max(0, int(params.get(name) or 0))
        except (TypeError, ValueError):
            return 0

    return {"attempt": number("after_attempt"), "seq": number("after_seq")}
