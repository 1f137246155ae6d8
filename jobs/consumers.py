"""The job log websocket: /ws/jobs/<id>/logs/?after_attempt=A&after_seq=S

Lines are always read from the database after the client's cursor; a hint
from the channel layer (services mode) or a short poll (embedded mode) says
when to read again. A reconnecting client passes its last cursor and gets
exactly the lines after it.
"""

import asyncio
import json
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from jobs.messages import Cursor, LinesMessage, LogAppendedHint, StateMessage, job_group, wire_lines
from jobs.models import FINAL_JOB_STATES, Job, LogLine

log = logging.getLogger("hangar.web")
BATCH = 1000
CLOSE_UNAUTHENTICATED = 4401
CLOSE_NOT_FOUND = 4404


class JobLogConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        self.job_id = int(self.scope["url_route"]["kwargs"]["job_id"])
        if not await database_sync_to_async(Job.objects.visible_to(user).filter(pk=self.job_id).exists)():
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.cursor: Cursor = cursor_from_query(self.scope.get("query_string", b""))
        self.wake = asyncio.Event()
        self.last_state: tuple | None = None
        if self.channel_layer is not None:
            await self.channel_layer.group_add(job_group(self.job_id), self.channel_name)
        await self.accept()
        self.pump = asyncio.create_task(self.stream())

    async def disconnect(self, code):
        if hasattr(self, "pump"):
            self.pump.cancel()
        if self.channel_layer is not None and hasattr(self, "job_id"):
            await self.channel_layer.group_discard(job_group(self.job_id), self.channel_name)

    async def log_appended(self, message: LogAppendedHint):
        self.wake.set()

    async def stream(self):
        try:
            await self.follow()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("log stream of job %s failed", self.job_id)
            await self.close(code=1011)  # the client reconnects from its cursor

    async def follow(self):
        """Send every stored line after the cursor, then the state; repeat on each hint or poll."""
        while True:
            self.wake.clear()
            lines, state = await self.read()
            if lines:
                await self.send_lines(lines)
                if len(lines) == BATCH:
                    continue
            if state != self.last_state:
                self.last_state = state
                final = state[0] in FINAL_JOB_STATES
                await self.send_state(state, final=final)
                if final:
                    return
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=settings.HANGAR_LOG_POLL_SECONDS)
            except TimeoutError:
                pass

    @database_sync_to_async
    def read(self):
        # The state is read before the lines: a final state seen here means
        # every line was stored before it, so none can come after "final".
        job = Job.objects.get(pk=self.job_id)
        latest = job.latest_attempt()
        lines = list(LogLine.after(self.job_id, self.cursor["attempt"], self.cursor["seq"])[:BATCH])
        return wire_lines(lines), (job.state, latest.state if latest else None, job.exit_code)

    async def send_lines(self, lines):
        self.cursor = {"attempt": lines[-1]["attempt"], "seq": lines[-1]["seq"]}
        message: LinesMessage = {"type": "lines", "lines": lines, "cursor": self.cursor}
        await self.send(text_data=json.dumps(message))

    async def send_state(self, state, final: bool):
        job_state, attempt_state, exit_code = state
        message: StateMessage = {
            "type": "state",
            "state": job_state,
            "attempt_state": attempt_state,
            "exit_code": exit_code,
            "final": final,
        }
        await self.send(text_data=json.dumps(message))


def cursor_from_query(query_string: bytes) -> Cursor:
    from urllib.parse import parse_qs

    params = parse_qs(query_string.decode("latin-1"))

    def number(name: str) -> int:
        try:
            return max(0, int(params.get(name, ["0"])[0]))
        except ValueError:
            return 0

    return {"attempt": number("after_attempt"), "seq": number("after_seq")}
