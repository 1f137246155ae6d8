"""From a job's pipes to stored log lines: reading, numbering, batching, storing.

Lines are stored first and pushed as a hint after, so a viewer never misses
one: it reads the database from its cursor.
"""

import logging
import queue
import threading
import time

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from fleet.agent import observe_output
from jobs.logparse import decode_line, severity_of
from jobs.messages import LogAppendedHint, job_group
from jobs.models import STARTED_ATTEMPT_STATES, Attempt, LogLine, Severity, Stream

log = logging.getLogger("hangar.agent")

MAX_BATCH = 5000


def read_lines(pipe, stream: int, out: queue.Queue) -> None:
    """Read one pipe to its end, line by line, never holding more than the line limit."""
    limit = settings.HANGAR_LOG_LINE_MAX_BYTES
    skipping = False
    with pipe:
        while chunk := pipe.readline(limit):
            complete = chunk.endswith(b"\n")
            if not skipping:
                out.put((stream, timezone.now(), chunk, not complete and len(chunk) >= limit))
            skipping = not complete and len(chunk) >= limit
    out.put((stream, None, None, False))


class LogWriter(threading.Thread):
    """Takes lines from the readers in arrival order, numbers them, and stores them in batches.

    A batch is whatever arrived while the previous one was being written, so an
    idle job's line is stored at once and a flood is stored in large inserts.
    """

    def __init__(self, attempt: Attempt, lines: queue.Queue):
        super().__init__(daemon=True, name=f"logs-{attempt.pk}")
        self.attempt = attempt
        self.lines = lines
        self.seq = 0
        self.open_streams = 0
        self.streams_done = threading.Event()
        self.streams_done.set()
        self.layer = get_channel_layer()

    def expect_streams(self, count: int) -> None:
        self.open_streams = count
        self.streams_done.clear()

    def wait_for_streams(self, timeout: float) -> bool:
        return self.streams_done.wait(timeout)

    def system(self, text: str, error: bool) -> None:
        self.lines.put((Stream.SYSTEM, timezone.now(), text.encode(), error))

    def close(self) -> None:
        self.lines.put(None)
        self.join()

    def run(self) -> None:
        try:
            done = False
            while not done:
                batch = [self.lines.get()]
                while len(batch) < MAX_BATCH:
                    try:
                        batch.append(self.lines.get_nowait())
                    except queue.Empty:
                        break
                done = batch[-1] is None
                self.store([item for item in batch if item is not None])
        finally:
            connection.close()

    def store(self, batch: list) -> None:
        rows = []
        for stream, ts, raw, flag in batch:
            if raw is None:
                self.open_streams -= 1
                if self.open_streams <= 0:
                    self.streams_done.set()
                continue
            rows.append(self.line(stream, ts, raw, flag))
        if rows:
            self.write(rows)

    def line(self, stream: int, ts, raw: bytes, flag: bool) -> LogLine:
        self.seq += 1
        if stream == Stream.SYSTEM:
            text = raw.decode()
            severity = Severity.ERROR if flag else Severity.INFO
        else:
            text = decode_line(raw, truncated=flag)
            severity = severity_of(text, stream)
            observe_output(self.attempt, text)  # NCCL/ECC/Xid in the job's output: fleet health
        attempt = self.attempt
        return LogLine(
            job_id=attempt.job_id,
            attempt_id=attempt.pk,
            node_id=attempt.node_id,
            rank=0,
            seq=self.seq,
            stream=stream,
            severity=severity,
            ts=ts,
            text=text,
        )

    def write(self, rows: list[LogLine]) -> None:
        for delay in (0.1, 0.5, 1, 2, 5, 10, 30):
            try:
                if not Attempt.objects.filter(pk=self.attempt.pk, state__in=STARTED_ATTEMPT_STATES).exists():
                    log.warning("attempt %s is no longer current: %d lines refused", self.attempt.pk, len(rows))
                    return
                LogLine.objects.bulk_create(rows)
                self.hint(rows[-1].seq)
                return
            except DatabaseError as exc:
                log.warning("storing %d log lines failed (%s); retrying in %ss", len(rows), exc, delay)
                close_old_connections()
                time.sleep(delay)
        log.error("attempt %s: %d log lines could not be stored", self.attempt.pk, len(rows))

    def hint(self, seq: int) -> None:
        if self.layer is None:
            return
        message: LogAppendedHint = {"type": "log.appended", "attempt": self.attempt.pk, "seq": seq}
        try:
            async_to_sync(self.layer.group_send)(job_group(self.attempt.job_id), message)
        except Exception as exc:  # a lost hint only delays delivery until the next poll
            log.debug("log hint not sent: %s", exc)
