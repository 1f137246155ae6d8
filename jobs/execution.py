"""Running one attempt on this node: the agent side of a job.

A Runner starts the command as a real process group, streams its output into
the database line by line (batched), watches for cancellation, the runtime
limit and the loss of its lease, and reports the exit. Every write carries the
attempt id and is refused once the attempt is no longer current.
"""

import logging
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from jobs.logparse import decode_line, severity_of
from jobs.messages import LogAppendedHint, job_group
from jobs.models import (
    STARTED_ATTEMPT_STATES,
    Attempt,
    AttemptState,
    FailureClass,
    LogLine,
    Severity,
    Stream,
    lease_from,
)

log = logging.getLogger("hangar.agent")

# Attempts this agent process is running, by id: the heartbeat and the
# shutdown hook reach them here.
RUNNING: dict[int, "Runner"] = {}
_running_lock = threading.Lock()

# Only these variables of the agent's own environment reach a job: the agent's
# database and broker credentials must not.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")

WATCH_SECONDS = 0.25
CHECK_SECONDS = 0.5
MAX_BATCH = 5000


def run_attempt(attempt_id: int) -> None:
    """Entry point of the agent's Celery task."""
    close_old_connections()
    try:
        attempt = Attempt.objects.select_related("job", "node", "job__project").filter(pk=attempt_id).first()
        if attempt is None or not attempt.begin():
            log.info("attempt %s is no longer current; nothing to run", attempt_id)
            return
        runner = Runner(attempt)
        with _running_lock:
            RUNNING[attempt.pk] = runner
        try:
            runner.run()
        finally:
            with _running_lock:
                RUNNING.pop(attempt.pk, None)
    finally:
        connection.close()


def stop_all(reason: str) -> None:
    """The agent is shutting down: end every running attempt as an infrastructure loss."""
    with _running_lock:
        runners = list(RUNNING.values())
    for runner in runners:
        runner.request_stop(AttemptState.LOST, FailureClass.INFRA, reason)


@dataclass
class Outcome:
    state: str
    failure_class: str
    reason: str


class Runner:
    def __init__(self, attempt: Attempt):
        self.attempt = attempt
        self.job = attempt.job
        self.lines: queue.Queue = queue.Queue()
        self.writer = LogWriter(attempt, self.lines)
        self.proc: subprocess.Popen | None = None
        self.stop_requested: Outcome | None = None
        self.current = True

    def run(self) -> None:
        self.writer.start()
        self.system(f"attempt {self.attempt.number} on node {self.attempt.node.name}, GPUs {self.gpu_list() or 'none'}")
        outcome, exit_code = self.preflight_and_execute()
        self.writer.close()
        if not self.current:
            log.warning("attempt %s lost its lease; its end is not recorded by this agent", self.attempt.pk)
            return
        if not self.attempt.finish(outcome.state, outcome.failure_class, outcome.reason, exit_code):
            log.warning("attempt %s was ended elsewhere; outcome %s dropped", self.attempt.pk, outcome.state)

    def preflight_and_execute(self) -> tuple[Outcome, int | None]:
        from fleet.preflight import failed_checks

        failures = failed_checks(self.attempt.node, self.attempt.gpu_indices, self.job.gpu_type)
        if failures:
            reason = "preflight failed: " + "; ".join(failures)
            self.system(reason, error=True)
            self.attempt.node.cordon(None, reason)
            return Outcome(AttemptState.FAILED, FailureClass.INFRA, reason), None
        try:
            self.proc = self.start_process()
        except OSError as exc:
            reason = f"could not start {self.job.command[0]!r}: {exc.strerror or exc}"
            self.system(reason, error=True)
            return Outcome(AttemptState.FAILED, FailureClass.USER, reason), 127 if isinstance(
                exc, FileNotFoundError
            ) else 126
        if not self.attempt.mark_running(self.proc.pid):
            self.request_stop(AttemptState.CANCELLED, FailureClass.CANCELLED, "cancelled before start")
        return self.watch()

    def gpu_list(self) -> str:
        return ",".join(str(i) for i in self.attempt.gpu_indices)

    def job_env(self) -> dict[str, str]:
        job, attempt = self.job, self.attempt
        env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
        env["PYTHONUNBUFFERED"] = "1"  # live logs from Python jobs unless the job says otherwise
        env.update({str(k): str(v) for k, v in job.env.items()})
        env.update(
            CUDA_VISIBLE_DEVICES=self.gpu_list(),
            HANGAR_JOB_ID=str(job.pk),
            HANGAR_ATTEMPT=str(attempt.number),
            HANGAR_PROJECT=job.project.slug,
            HANGAR_NODE=attempt.node.name,
            HANGAR_CHECKPOINT_DIR=str(self.workdir() / "checkpoints"),
        )
        return env

    def workdir(self) -> Path:
        return settings.HANGAR_JOB_WORKDIR / str(self.job.pk)

    def start_process(self) -> subprocess.Popen:
        (self.workdir() / "checkpoints").mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            self.job.command,
            env=self.job_env(),
            cwd=self.workdir(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so cancel reaches every child
        )
        for pipe, stream in ((proc.stdout, Stream.STDOUT), (proc.stderr, Stream.STDERR)):
            threading.Thread(target=read_lines, args=(pipe, stream, self.lines), daemon=True).start()
        self.writer.expect_streams(2)
        return proc

    def watch(self) -> tuple[Outcome, int | None]:
        deadline = time.monotonic() + self.job.max_runtime_seconds
        next_check = 0.0
        lease_ok_at = time.monotonic()
        while self.proc.poll() is None:
            now = time.monotonic()
            if self.stop_requested is None and now >= deadline:
                limit = self.job.max_runtime_seconds
                self.request_stop(AttemptState.FAILED, FailureClass.TIMEOUT, f"exceeded max runtime of {limit}s")
            if now >= next_check:
                next_check = now + CHECK_SECONDS
                if self.check_current():
                    lease_ok_at = now
                elif now - lease_ok_at > settings.HANGAR_LEASE_SECONDS:
                    self.current = False
            if self.stop_requested is not None or not self.current:
                return self.terminate()
            time.sleep(WATCH_SECONDS)
        return self.exited(self.proc.returncode)

    def check_current(self) -> bool:
        """Renew the lease and look for a cancel. False when the database could not be reached."""
        try:
            renewed = Attempt.objects.filter(pk=self.attempt.pk, state__in=STARTED_ATTEMPT_STATES).update(
                lease_expires_at=lease_from(timezone.now())
            )
            if not renewed:
                self.current = False  # ended elsewhere (lease expired, reconciled): stop at once
                return True
            cancel = Attempt.objects.filter(pk=self.attempt.pk).values_list("cancel_requested_at", "reason").first()
        except DatabaseError as exc:
            log.warning("attempt %s: cannot reach the database to renew its lease: %s", self.attempt.pk, exc)
            close_old_connections()
            return False
        if cancel and cancel[0] is not None and self.stop_requested is None:
            self.request_stop(AttemptState.CANCELLED, FailureClass.CANCELLED, cancel[1] or "cancelled")
        return True

    def request_stop(self, state: str, failure_class: str, reason: str) -> None:
        if self.stop_requested is None:
            self.stop_requested = Outcome(state, failure_class, reason)

    def terminate(self) -> tuple[Outcome, int | None]:
        """SIGTERM the whole process group, wait the grace period, then SIGKILL it."""
        grace = settings.HANGAR_KILL_GRACE_SECONDS
        outcome = self.stop_requested or Outcome(AttemptState.LOST, FailureClass.INFRA, "lease lost")
        self.system(f"stopping: {outcome.reason} (SIGTERM, then SIGKILL after {grace:g}s)", error=True)
        signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        signal_group(self.proc.pid, signal.SIGKILL)
        self.writer.wait_for_streams(timeout=5)
        return outcome, exit_status(self.proc.returncode)

    def exited(self, returncode: int) -> tuple[Outcome, int | None]:
        # Children the command left behind belong to the job: end them too.
        signal_group(self.proc.pid, signal.SIGTERM)
        if not self.writer.wait_for_streams(timeout=2):
            signal_group(self.proc.pid, signal.SIGKILL)
            self.writer.wait_for_streams(timeout=5)
        code = exit_status(returncode)
        if code == 0:
            self.system("exited with code 0")
            return Outcome(AttemptState.SUCCEEDED, "", "exited with code 0"), 0
        reason = describe_exit(returncode)
        self.system(reason, error=True)
        return Outcome(AttemptState.FAILED, FailureClass.USER, reason), code

    def system(self, text: str, error: bool = False) -> None:
        self.writer.system(f"[hangar] {text}", error)


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


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exit_status(returncode: int | None) -> int | None:
    """Shell convention: a process killed by signal N exits with 128 + N."""
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name} (exit code {128 - returncode})"
    return f"exited with code {returncode}"
