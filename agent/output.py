"""From a job's pipes to stored log lines, on the node: reading, parsing, batching, spooling.
(Storing a batch, the part the server side shares, is jobs/logstore.py.)

Lines are stored first and pushed as a hint after, so a viewer never misses
one: it reads the database from its cursor.

Several writers may store lines of one attempt at once (one per rank of a
multi-node job, each on its own agent). Each batch is stored in one
transaction that first locks the attempt's row: that is the fence (an attempt
that is no longer current takes no lines) and it serialises the writers, so
each batch takes the seq numbers right after the last stored one and commits
before the next batch can take any. A reader's cursor therefore never skips a
range that commits later.

Reader threads put lines on a bounded queue: a job printing faster than the
database stores is held to its pace (its pipe fills) instead of the agent's
memory growing with the backlog. While the database is unreachable the writer moves
whatever arrives to a spool file on local disk and sends it, in order, once
the database answers again. A spool left behind by an agent that died is sent
by the node's next agent when it starts (replay_spools).

Storing is idempotent: the writer numbers its rank's lines itself (rank_seq),
and a batch stores only the lines after the last one its rank already stored.
So a batch whose commit the writer never saw acknowledged (the connection
dropped after COMMIT), sent again from the spool, is stored once.
"""

import json
import logging
import queue
import threading
import time
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from agent import connections, helpers, hints
from agent.watch import observe_output
from jobs import logmetrics, tracking
from jobs.logparse import SeverityReader, decode_line, is_fault
from jobs.logstore import AttemptNotCurrent, NewLine, store_lines
from jobs.messages import LogAppendedHint, job_group
from jobs.models import Attempt, Severity, Stream

log = logging.getLogger("hangar.agent")

MAX_BATCH = 5000
# How long a line of Hangar's own ("attempt 1 on node ...") waits for the job's first output
# to share its write: under a second is live to a reader, and a write is ~4 statements.
SYSTEM_LINGER_SECONDS = 0.1
MAX_BATCH_BYTES = 4 * 1024 * 1024


READ_BYTES = 64 * 1024


def read_lines(pipe, stream: int, out: queue.Queue) -> None:
    """Read one pipe to its end, never holding more than the line limit of an unfinished line.

    The lines of one read go on the queue as one item (stream, time, [(raw, cut), ...], False)
    with one timestamp: they arrived together, and in a flood a queue item and a
    clock read per line cost as much as parsing the line.
    """
    lines = LineSplitter(settings.HANGAR_LOG_LINE_MAX_BYTES)
    with pipe:
        while data := pipe.read1(READ_BYTES):
            if complete := lines.feed(data):
                out.put((stream, timezone.now(), complete, False))
        if last := lines.end():
            out.put((stream, timezone.now(), last, False))
    out.put((stream, None, None, False))


class LineSplitter:
    """Cuts a byte stream into lines (without their newline); a line longer than `limit`
    is cut there and flagged, the rest of it dropped."""

    def __init__(self, limit: int):
        self.limit = limit
        self.tail = b""  # the unfinished line, shorter than the limit
        self.skipping = False  # inside a line that was cut

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        parts = (self.tail + data).split(b"\n")
        self.tail = parts.pop()
        if self.skipping and parts:
            parts.pop(0)  # the end of the line that was cut
            self.skipping = False
        limit = self.limit
        lines = [(part, False) if len(part) < limit else (part[:limit], True) for part in parts]
        if self.skipping:
            self.tail = b""
        elif len(self.tail) >= limit:
            lines.append((self.tail[:limit], True))
            self.tail, self.skipping = b"", True
        return lines

    def end(self) -> list[tuple[bytes, bool]]:
        """The last line when the stream did not end with a newline."""
        return [(self.tail, False)] if self.tail else []


class Spool:
    """Lines waiting on local disk for the database, oldest first (one JSON array per line)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0  # bytes of the file already stored

    def __bool__(self) -> bool:
        return self.path.exists()

    def append(self, rows: list[NewLine]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as out:
            for r in rows:
                fields = [r.job_id, r.attempt_id, r.node_id, r.rank, r.stream, r.severity, r.fault]
                out.write(json.dumps([*fields, r.ts.isoformat(), r.text, r.rank_seq]) + "\n")

    def chunks(self, size: int = MAX_BATCH):
        """(rows, end offset) from the first unstored line on; call done(end) once a chunk is stored."""
        with open(self.path, encoding="utf-8") as spool:
            spool.seek(self.offset)
            while True:
                rows = []
                while len(rows) < size and (text := spool.readline()):
                    if not text.endswith("\n"):
                        break  # cut off by a crash in mid-write: never complete, never stored
                    *fields, ts, line, rank_seq = json.loads(text)
                    rows.append(NewLine(*fields, datetime.fromisoformat(ts), line, rank_seq))
                if not rows:
                    return
                yield rows, spool.tell()

    def done(self, offset: int) -> None:
        self.offset = offset

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        self.offset = 0


def is_system(item: tuple | None) -> bool:
    """A line of Hangar's own (an end or a job's line is not)."""
    return item is not None and item[0] == Stream.SYSTEM


def weigh(item: tuple | None) -> tuple[int, int]:
    """Lines and bytes in one queue item: a line, a reader's list of lines, or an end."""
    raw = item[2] if item is not None else None
    if raw is None:
        return 0, 0
    if isinstance(raw, list):
        return len(raw), sum(len(line) for line, _ in raw)
    return 1, len(raw)


class LogWriter:
    """Takes one rank's lines from its readers in arrival order, parses them, and stores them in batches.

    A batch is whatever arrived while the previous one was being parsed (up to
    MAX_BATCH lines or MAX_BATCH_BYTES), so an idle job's line is stored at
    once and a flood is stored in large inserts. Parsing runs on one helper
    thread (agent/helpers.py) and storing on a second one (the storer), one
    batch apart: the database's time and the parsing overlap instead of adding
    up (the storer waits on the socket without the GIL).
    """

    def __init__(self, attempt: Attempt, lines: queue.Queue, rank: int = 0, node_id: int | None = None):
        self.name = f"logs-{attempt.pk}-{rank}"
        self.running: helpers.Running | None = None  # run(), once started
        self.attempt = attempt
        self.lines = lines
        self.rank = rank
        self.node_id = attempt.node_id if node_id is None else node_id
        self.seq = 0  # the last seq this writer stored
        # A one-rank attempt's lines are this writer's alone: after each batch it stored, it
        # knows the attempt's last seq (jobs/logstore.py `last`).
        self.sole_writer = len(attempt.ranks) <= 1
        self.open_streams = 0  # streams expected and not ended yet (below 0: ended before they were expected)
        self.streams_lock = threading.Lock()
        self.streams_done = threading.Event()
        self.streams_done.set()
        self.severity = {stream: SeverityReader(stream) for stream in (Stream.STDOUT, Stream.STDERR)}
        self.spool = Spool(spool_dir(self.node_id) / f"attempt-{attempt.pk}-rank-{rank}.jsonl")
        self.read = 0  # lines parsed so far: the next line's rank_seq - 1
        self.retry_at = 0.0
        self.retry_delay = 0.0
        self.refused = False
        # Cut off from the database (spooling) since when, and lines stored after their attempt
        # ended: a rank partitioned while its attempt was ended elsewhere (its lease expired).
        self.cut_off_at = self.back_at = None
        self.late_lines = 0
        self.ended_seen_at = None  # when a write first found the attempt ended
        self.unreachable = False  # a write failed: the database could not be reached
        self.batches = 0
        self.stored = 0
        self.parsed: queue.Queue = queue.Queue(maxsize=1)  # parser -> storer; None ends
        # metrics_from_log (jobs/logmetrics.py): matched by the parser, sent to MLflow by the storer.
        self.metrics = logmetrics.for_job(attempt.job, rank) if tracking.enabled() else None
        self.metric_points: queue.SimpleQueue = queue.SimpleQueue()

    def read_from(self, pipes: list[tuple], out) -> None:
        """Read each (pipe, stream) to its end on a thread of its own, into `out` (this writer's
        queue, or a wrapper of it). The streams are counted before any reader starts: a process
        that exits at once can end its streams before `expect_streams` would have counted them,
        and its runner then waited out wait_for_streams (2 s, then SIGKILL and 5 s more)."""
        self.expect_streams(len(pipes))
        for pipe, stream in pipes:
            helpers.start(read_lines, pipe, stream, out, name=f"{self.name}-{Stream(stream).label.lower()}")

    def expect_streams(self, count: int) -> None:
        """`count` more streams will end on this writer. Ends already parsed count against them
        (a reader started before this call may have reached its end first)."""
        self.stream_ended(-count)

    def stream_ended(self, count: int = 1) -> None:
        with self.streams_lock:
            self.open_streams -= count
            if self.open_streams <= 0:
                self.streams_done.set()
            else:
                self.streams_done.clear()

    def wait_for_streams(self, timeout: float) -> bool:
        return self.streams_done.wait(timeout)

    def start(self) -> None:
        """Parse and store on a helper thread until close()."""
        self.running = helpers.start(self.run, name=self.name)

    def join(self, timeout: float | None = None) -> None:
        if self.running is not None:
            self.running.join(timeout)

    def is_alive(self) -> bool:
        return self.running is not None and self.running.is_alive()

    def system(self, text: str, error: bool) -> None:
        self.put((Stream.SYSTEM, timezone.now(), text.encode(), error))

    def close(self) -> None:
        self.put(None)
        self.join()

    def put(self, item) -> None:
        """Queue an item even when the queue is bounded and full; give up only if this
        writer is no longer there to drain it (never block the runner for ever)."""
        while True:
            try:
                self.lines.put(item, timeout=1.0)
                return
            except queue.Full:
                if not self.is_alive():
                    return

    def run(self) -> None:
        with _live_lock:
            LIVE_SPOOLS.add(self.spool.path)  # its storer's from now on, not the heartbeat's replay
        storer = helpers.start(self.store_forever, name=f"{self.name}-store")
        try:
            done = False
            while not done:
                batch = self.collect()
                done = batch[-1] is None
                self.parse([item for item in batch if item is not None], storer)
        finally:
            self.hand_over(None, storer)
            storer.join()
            connection.close()  # this thread's own, used by health findings in the output

    def store_forever(self) -> None:
        """The storer: deliver each parsed batch in order, retrying spooled lines when idle."""
        try:
            while True:
                if self.parsed.empty():  # about to wait for the job's next lines
                    connections.hand_back()
                try:
                    rows = self.parsed.get(timeout=self.spool_wait() if self.spool else None)
                except queue.Empty:  # nothing new while lines wait on disk: time to retry them
                    self.flush_spool(0)
                    continue
                if rows is None:
                    break
                self.deliver(rows)
                self.send_metrics()
            self.send_metrics()
            self.flush_spool(settings.HANGAR_LOG_SPOOL_FLUSH_SECONDS)
            if self.late_lines and not self.spool:  # every spooled line is stored: say which came late
                self.note_late_lines()
            log.info("attempt %s rank %s: %d lines, %d batches", self.attempt.pk, self.rank, self.stored, self.batches)
        finally:
            with _live_lock:
                LIVE_SPOOLS.discard(self.spool.path)  # lines it could not send: the heartbeat retries them
            connection.close()

    def hand_over(self, rows: list[NewLine] | None, storer: helpers.Running) -> None:
        """Queue a parsed batch for the storer; waits while it stores the previous one, unless it died."""
        while storer.is_alive():
            try:
                self.parsed.put(rows, timeout=0.5)
                return
            except queue.Full:
                continue
        if rows:
            log.error("attempt %s rank %s: log storer died, %d lines lost", self.attempt.pk, self.rank, len(rows))

    def collect(self) -> list:
        """Block for one line, then take what else is waiting. Hangar's own lines wait up to
        SYSTEM_LINGER_SECONDS for what comes next (the job's own lines are never held): a short
        job's start line and first output are one write, not two."""
        batch = [self.lines.get()]
        count, size = weigh(batch[0])
        linger_until = time.monotonic() + SYSTEM_LINGER_SECONDS if is_system(batch[0]) else None
        while batch[-1] is not None and count < MAX_BATCH and size < MAX_BATCH_BYTES:
            try:
                if linger_until is None:
                    item = self.lines.get_nowait()
                else:
                    item = self.lines.get(timeout=max(0.0, linger_until - time.monotonic()))
            except queue.Empty:
                break
            if not is_system(item):
                linger_until = None  # the job's own line: it and what is waiting go now
            batch.append(item)
            lines, length = weigh(item)
            count, size = count + lines, size + length
        return batch

    def spool_wait(self) -> float:
        return max(0.05, self.retry_at - time.monotonic())

    def parse(self, batch: list, storer: helpers.Running) -> None:
        rows = []
        for stream, ts, raw, flag in batch:
            if raw is None:
                self.stream_ended()
            elif isinstance(raw, list):  # a reader's lines of one read
                rows.extend(self.line(stream, ts, line, cut) for line, cut in raw)
            else:
                rows.append(self.line(stream, ts, raw, flag))
        if self.metrics is not None and (points := self.metrics.take()):
            self.metric_points.put(points)
        if rows:
            self.hand_over(rows, storer)

    def send_metrics(self) -> None:
        """The metrics matched in the lines parsed so far, to the job's MLflow run (the storer's thread)."""
        points = []
        while not self.metric_points.empty():
            points.extend(self.metric_points.get_nowait())
        if points:
            logmetrics.send(self.attempt.job.mlflow_run_id, points)

    def line(self, stream: int, ts, raw: bytes, flag: bool) -> NewLine:
        """One line, parsed. Per-line checks of the job's output (fault scans) belong here."""
        if stream == Stream.SYSTEM:
            text = raw.decode()
            severity = Severity.ERROR if flag else Severity.INFO
        else:
            text = decode_line(raw, truncated=flag)
            severity = self.severity[stream](text)
            observe_output(self.attempt, text, self.rank, self.read + 1)  # NCCL/ECC/Xid: fleet health
            if self.metrics is not None:
                self.metrics.scan(text)  # metrics_from_log: each line once, here
        attempt = self.attempt
        self.read += 1
        return NewLine(
            job_id=attempt.job_id,
            attempt_id=attempt.pk,
            node_id=self.node_id,
            rank=self.rank,
            stream=stream,
            severity=severity,
            fault=stream != Stream.SYSTEM and is_fault(text),
            ts=ts,
            text=text,
            rank_seq=self.read,
        )

    def deliver(self, rows: list[NewLine]) -> None:
        """Store the rows, or spool them behind older spooled lines until the database answers."""
        if self.refused:
            return
        if self.spool:
            self.spool.append(rows)
            if time.monotonic() >= self.retry_at:
                self.flush_spool(0)
            return
        try:
            self.write(rows)
        except DatabaseError as exc:
            log.warning("attempt %s: %d log lines spooled to disk: %s", self.attempt.pk, len(rows), exc)
            self.cut_off_at = self.cut_off_at or timezone.now()
            self.unreachable = True
            self.spool.append(rows)
            self.backoff()

    def flush_spool(self, patience: float) -> None:
        """Send the spooled lines in order; keep trying for `patience` seconds."""
        deadline = time.monotonic() + patience
        while self.spool and not self.refused:
            try:
                for rows, end in self.spool.chunks():
                    self.write(rows, spooled=True)
                    if self.refused:
                        return
                    self.spool.done(end)
                self.spool.discard()
                self.retry_delay = 0.0
                return
            except DatabaseError as exc:
                log.warning("attempt %s: spooled log lines still not stored: %s", self.attempt.pk, exc)
                self.backoff()
                if time.monotonic() + self.retry_delay > deadline:
                    if patience:
                        log.error("attempt %s: log lines left unsent in %s", self.attempt.pk, self.spool.path)
                    return
                time.sleep(self.retry_delay)

    def backoff(self) -> None:
        close_old_connections()
        connection.close()  # a broken connection is not reused
        self.retry_delay = min(max(self.retry_delay * 2, 0.2), 5.0)
        self.retry_at = time.monotonic() + self.retry_delay

    def write(self, rows: list[NewLine], spooled: bool = False) -> None:
        """Store a batch. Into an attempt that is no longer current, only what the rank printed
        before it could know: a spooled batch (printed while it could not reach the database), or
        lines printed before the first refusal (a write that hung through a partition, then found
        the attempt ended). Those are stored late into their attempt, as a dead agent's spools
        are; what the rank prints after it was told is refused (the fence) while it is stopped."""
        try:
            known = self.seq if self.sole_writer and not spooled else None
            self.seq = store_lines(self.attempt.pk, rows, fresh=not spooled, last=known)
        except AttemptNotCurrent:
            self.ended_seen_at = self.ended_seen_at or timezone.now()
            before = rows if spooled else [r for r in rows if r.ts <= self.ended_seen_at]
            if not before or not self.store_late(before):
                log.warning("attempt %s is no longer current: its log lines are refused", self.attempt.pk)
                self.refused = True
                self.spool.discard()
                return
            if len(before) < len(rows):
                self.refused = True  # the rest came after the refusal
                return
        self.batches += 1
        self.stored += len(rows)
        self.hint(self.seq)

    def store_late(self, rows: list[NewLine]) -> bool:
        try:
            self.seq = store_lines(self.attempt.pk, rows, current_only=False)
        except AttemptNotCurrent:  # not even an ended attempt: it was deleted
            return False
        self.late_lines += len(rows)
        self.cut_off_at = self.cut_off_at or rows[0].ts  # a write that hung: from its first line
        self.back_at = self.back_at or timezone.now()
        return True

    def note_late_lines(self) -> None:
        """A line of the attempt's own saying which lines came late, and why (after the parser ended)."""
        since = f" from {self.cut_off_at:%H:%M:%S} to {self.back_at:%H:%M:%S} UTC" if self.cut_off_at else ""
        if self.unreachable:
            text = (
                f"[hangar] rank {self.rank} could not reach the database{since} and its attempt ended meanwhile; "
                f"the {self.late_lines} lines it printed while cut off are stored late, after the attempt's end"
            )
        else:
            text = (
                f"[hangar] rank {self.rank}'s attempt ended elsewhere before its last {self.late_lines} lines "
                f"(printed{since}) were stored: they are stored late, after the attempt's end"
            )
        self.read += 1
        note = NewLine(
            self.attempt.job_id, self.attempt.pk, self.node_id, self.rank, Stream.SYSTEM, Severity.WARNING,
            False, timezone.now(), text, self.read,
        )  # fmt: skip
        try:
            store_lines(self.attempt.pk, [note], current_only=False)
        except (DatabaseError, AttemptNotCurrent) as exc:
            log.warning("attempt %s: the late-lines note was not stored: %s", self.attempt.pk, exc)

    def hint(self, seq: int) -> None:
        message: LogAppendedHint = {"type": "log.appended", "attempt": self.attempt.pk, "seq": seq}
        hints.sender.send(job_group(self.attempt.job_id), message)  # not waited for: it is a nudge


# The spool files of this process's live writers (their storers send them); guarded by _live_lock.
LIVE_SPOOLS: set[Path] = set()
_live_lock = threading.Lock()


def spool_dir(node_id: int | None) -> Path:
    """One folder per node: agents of several nodes on one machine replay only their own spools."""
    return settings.HANGAR_LOG_SPOOL_DIR / f"node-{node_id or 0}"


def replay_spools(node_id: int) -> int:
    """Store the spooled lines left on disk for this node, the number of files sent: a dead
    agent's (at the agent's start), or a writer's that gave up on them, its database still
    unreachable when its rank ended (at every heartbeat). A live writer's own are skipped.

    An ended attempt's lines are still what it printed, so they are stored; lines of an
    attempt that no longer exists are dropped. A file that cannot be sent now stays for the
    next try, and sending it again stores nothing twice.
    """
    sent = 0
    for path in sorted(spool_dir(node_id).glob("attempt-*-rank-*.jsonl")):
        # Looked up as each file comes, not once before the loop: a writer claims its file before
        # it can make it and lets go after its last line, so a file no live writer claims now
        # gets no more lines (a writer started after a look made once could be spooling into it).
        with _live_lock:
            live = path in LIVE_SPOOLS
        if not live and replay_spool(path):
            sent += 1
    return sent


def replay_spool(path: Path) -> bool:
    """Send one spool file and remove it; False when it could not be sent (it stays)."""
    spool = Spool(path)
    try:
        for rows, _ in spool.chunks():
            store_lines(rows[0].attempt_id, rows, current_only=False)
    except AttemptNotCurrent as gone:
        log.warning("spooled log lines of attempt %s dropped: it no longer exists", gone)
    except (DatabaseError, ValueError, TypeError) as exc:  # unreachable, or a file it cannot read
        log.error("spooled log lines in %s not sent: %s", path, exc)
        return False
    spool.discard()
    return True
