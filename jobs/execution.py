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

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from jobs import tracking
from jobs.logingest import LogWriter, read_lines
from jobs.models import STARTED_ATTEMPT_STATES, Attempt, AttemptState, FailureClass, Stream, lease_from

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
        env.update(tracking.job_env(job, attempt))  # MLFLOW_*; the job's own env may override them
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
