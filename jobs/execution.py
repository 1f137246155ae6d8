"""Running one rank of an attempt on this node: the agent side of a job.

A Runner starts the command as a real process group, streams its output into
the database line by line (batched), watches for cancellation, preemption, the
runtime limit and the loss of its lease, and reports the exit. Every write
carries the attempt id and is refused once the attempt is no longer current.

A multi-node attempt has one Runner per rank, each on its own node's agent,
started with torchrun-style variables. The attempt succeeds when every rank
exited 0; the first rank that fails ends it, and the other ranks, finding it
ended when they renew its lease, stop their processes.
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
from jobs.environments import command_for
from jobs.logingest import LogWriter, read_lines
from jobs.models import STARTED_ATTEMPT_STATES, Attempt, AttemptState, FailureClass, Stream, lease_from
from portal.models import volume_env_name

log = logging.getLogger("hangar.agent")

# Attempts this agent process is running, by id: the heartbeat and the
# shutdown hook reach them here.
RUNNING: dict[int, "Runner"] = {}
_running_lock = threading.Lock()

# Only these variables of the agent's own environment reach a job: the agent's
# database and broker credentials must not.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")

WATCH_SECONDS = 0.25
CHECK_SECONDS = 0.5  # how soon a cancel or preemption reaches the process


def renew_every() -> float:
    """Seconds between lease renewals (a write): a sixth of the lease, between every check and 5 s."""
    return min(max(settings.HANGAR_LEASE_SECONDS / 6, CHECK_SECONDS), 5.0)


def run_attempt(attempt_id: int, rank: int = 0) -> None:
    """Entry point of the agent's Celery task: run one rank of an attempt."""
    close_old_connections()
    try:
        attempt = Attempt.objects.select_related("job", "node", "job__project", "job__environment").filter(
            pk=attempt_id
        )
        attempt = attempt.first()
        if attempt is None or not attempt.begin(rank):
            log.info("attempt %s rank %s is taken or no longer current; nothing to run", attempt_id, rank)
            return
        runner = Runner(attempt, rank)
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
    def __init__(self, attempt: Attempt, rank: int = 0):
        from fleet.models import Node

        self.attempt = attempt
        self.job = attempt.job
        self.rank = rank
        placement = attempt.ranks[rank]
        self.node = (
            attempt.node if placement["node_id"] == attempt.node_id else Node.objects.get(pk=placement["node_id"])
        )
        self.gpus: list[int] = placement["gpus"]
        self.master = attempt.node  # rank 0's node: MASTER_ADDR for every rank
        # This runner's view of its attempt is its rank's placement: the agent's
        # telemetry, preflight and output monitoring read node and GPUs from it.
        # (Never saved: attempt rows change only through conditional updates.)
        attempt.gpu_indices = self.gpus
        attempt.node = self.node
        self.lines: queue.Queue = queue.Queue()
        self.writer = LogWriter(attempt, self.lines, rank=rank, node_id=self.node.pk)
        self.proc: subprocess.Popen | None = None
        self.stop_requested: Outcome | None = None
        self.current = True

    @property
    def world_size(self) -> int:
        return len(self.attempt.ranks)

    def run(self) -> None:
        self.writer.start()
        try:
            self.run_rank()
        except Exception:
            # The database or the broker failed under us: leave nothing running that no one
            # watches. The attempt's lease then expires and the reconciler requeues the job.
            log.exception("attempt %s rank %s: the runner failed", self.attempt.pk, self.rank)
            if self.proc is not None and self.proc.poll() is None:
                signal_group(self.proc.pid, signal.SIGKILL)
            raise
        finally:
            if self.writer.is_alive():
                self.writer.close()

    def run_rank(self) -> None:
        where = f"on node {self.node.name}, GPUs {self.gpu_list() or 'none'}"
        rank = f" rank {self.rank} of {self.world_size}" if self.world_size > 1 else ""
        self.system(f"attempt {self.attempt.number}{rank} {where}")
        outcome, exit_code = self.preflight_and_execute()
        others_running = outcome.state == AttemptState.SUCCEEDED and self.current and self.world_size > 1
        if others_running and not self.attempt.rank_succeeded(self.rank):
            self.system(f"rank {self.rank} done; the attempt ends when every rank has")
            self.close_writer()
            return
        self.close_writer()
        if not self.current:
            log.warning("attempt %s ended elsewhere or lost its lease; rank %s stopped", self.attempt.pk, self.rank)
            return
        if not self.attempt.finish(outcome.state, outcome.failure_class, outcome.reason, exit_code):
            log.warning("attempt %s was ended elsewhere; outcome %s dropped", self.attempt.pk, outcome.state)

    def close_writer(self) -> None:
        """Wait until every line is stored, renewing the lease meanwhile. After a flood of
        output (or across a database outage) storing the backlog can outlast the lease,
        and an expired lease would end, and requeue, an attempt whose command already
        exited: the job would run again."""
        self.lines.put(None)  # what LogWriter.close() sends, without its unbounded join
        next_renew = 0.0  # at once: exited() may just have waited up to 7 s for the streams
        while self.writer.is_alive():
            self.writer.join(WATCH_SECONDS)
            if self.current and time.monotonic() >= next_renew:
                next_renew = time.monotonic() + renew_every()
                self.check_current(renew=True)

    def preflight_and_execute(self) -> tuple[Outcome, int | None]:
        from fleet.preflight import run_preflight

        if not self.wait_for_gpus():
            outcome = self.stop_requested or Outcome(
                AttemptState.LOST, FailureClass.INFRA, "the attempt ended while it waited for its GPUs"
            )
            return outcome, None
        failures = run_preflight(self.attempt, self.job.gpu_type)  # records each check; a failure cordons
        if failures:
            reason = "preflight failed: " + "; ".join(failures)
            self.system(reason, error=True)
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

    def wait_for_gpus(self) -> bool:
        """Start only when no process of an earlier attempt on this agent still holds one of
        our GPUs. An ended attempt's rank can outlive its row's final state by its grace
        period (a preempted job writing its checkpoint); a new process must not share the
        GPU with it, nor read a checkpoint it is still writing. False if the attempt ended
        or was stopped meanwhile (the lease is renewed while waiting)."""
        announced = False
        next_check = 0.0
        while True:
            with _running_lock:
                holders = sorted(
                    r.attempt.pk
                    for r in RUNNING.values()
                    if r is not self and r.proc is not None and set(r.gpus) & set(self.gpus)
                )
            if not holders:
                return True
            if not announced:
                announced = True
                self.system(f"waiting for attempt {', '.join(map(str, holders))} to release GPUs {self.gpu_list()}")
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_SECONDS
                self.check_current(renew=True)
            if self.stop_requested is not None or not self.current:
                return False
            time.sleep(WATCH_SECONDS)

    def gpu_list(self) -> str:
        return ",".join(str(i) for i in self.gpus)

    def job_env(self) -> dict[str, str]:
        job, attempt = self.job, self.attempt
        env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
        env["PYTHONUNBUFFERED"] = "1"  # live logs from Python jobs unless the job says otherwise
        env.update(tracking.job_env(job, attempt))  # MLFLOW_*; the job's own env may override them
        env.update({str(k): str(v) for k, v in job.env.items()})
        env.update({str(k): str(v) for k, v in job.secret_env.items()})
        env.update({volume_env_name(v["name"]): v["path"] for v in job.volumes})
        env.update(
            CUDA_VISIBLE_DEVICES=self.gpu_list(),
            HANGAR_JOB_ID=str(job.pk),
            HANGAR_ATTEMPT=str(attempt.number),
            HANGAR_PROJECT=job.project.slug,
            HANGAR_NODE=self.node.name,
            HANGAR_CHECKPOINT_DIR=str(job.checkpoint_dir()),
            **rank_env(attempt, self.rank, self.master_addr()),
        )
        return env

    def master_addr(self) -> str:
        if self.world_size == 1:
            return "127.0.0.1"
        return self.master.hostname or self.master.name

    def workdir(self) -> Path:
        return settings.HANGAR_JOB_WORKDIR / str(self.job.pk)

    def start_process(self) -> subprocess.Popen:
        self.job.checkpoint_dir().mkdir(parents=True, exist_ok=True)
        argv, env = command_for(
            self.job, self.job_env(), self.gpus, self.workdir(), f"hangar-{self.attempt.pk}-{self.rank}"
        )
        proc = subprocess.Popen(
            argv,
            env=env,
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
        next_check = next_renew = 0.0
        lease_ok_at = time.monotonic()
        while self.proc.poll() is None:
            now = time.monotonic()
            if self.stop_requested is None and now >= deadline:
                limit = self.job.max_runtime_seconds
                self.request_stop(AttemptState.FAILED, FailureClass.TIMEOUT, f"exceeded max runtime of {limit}s")
            if now >= next_check:
                next_check = now + CHECK_SECONDS
                renew = now >= next_renew
                if self.check_current(renew):
                    lease_ok_at = now
                    if renew:
                        next_renew = now + renew_every()
                elif now - lease_ok_at > settings.HANGAR_LEASE_SECONDS:
                    self.current = False
            if self.stop_requested is not None or not self.current:
                return self.terminate()
            time.sleep(WATCH_SECONDS)
        return self.exited(self.proc.returncode)

    def check_current(self, renew: bool = True) -> bool:
        """Look for a cancel or preemption and, when `renew`, renew the lease. The renewal
        is one conditional write that matches only a started attempt nobody asked to stop;
        the row is read when it matches nothing, or when only looking. False when the
        database could not be reached."""
        try:
            if renew:
                renewed = Attempt.objects.filter(
                    pk=self.attempt.pk,
                    state__in=STARTED_ATTEMPT_STATES,
                    cancel_requested_at__isnull=True,
                    preempt_requested_at__isnull=True,
                ).update(lease_expires_at=lease_from(timezone.now()))
                if renewed:
                    return True
            row = (
                Attempt.objects.filter(pk=self.attempt.pk)
                .values_list("state", "cancel_requested_at", "preempt_requested_at", "reason")
                .first()
            )
            if renew and row is not None and row[0] in STARTED_ATTEMPT_STATES:
                # Asked to stop: keep the lease while the process gets its grace period.
                Attempt.objects.filter(pk=self.attempt.pk, state__in=STARTED_ATTEMPT_STATES).update(
                    lease_expires_at=lease_from(timezone.now())
                )
        except DatabaseError as exc:
            log.warning("attempt %s: cannot reach the database to renew its lease: %s", self.attempt.pk, exc)
            close_old_connections()
            return False
        state, cancel_at, preempt_at, reason = row or (None, None, None, "")
        if state not in STARTED_ATTEMPT_STATES:
            self.current = False  # ended elsewhere (another rank, the reconciler): stop at once
        if cancel_at is not None:
            self.request_stop(AttemptState.CANCELLED, FailureClass.CANCELLED, reason or "cancelled")
        elif preempt_at is not None:
            # Every rank of a preempted attempt gets the preemption grace period, also the
            # ranks that learn of it only after another rank has ended the attempt.
            self.request_stop(AttemptState.PREEMPTED, FailureClass.PREEMPTED, reason or "preempted")
        return True

    def request_stop(self, state: str, failure_class: str, reason: str) -> None:
        if self.stop_requested is None:
            self.stop_requested = Outcome(state, failure_class, reason)

    def terminate(self) -> tuple[Outcome, int | None]:
        """SIGTERM the whole process group, wait the grace period, then SIGKILL it."""
        outcome = self.stop_requested or Outcome(
            AttemptState.LOST, FailureClass.INFRA, "the attempt ended elsewhere (another rank failed) or lost its lease"
        )
        preempted = outcome.failure_class == FailureClass.PREEMPTED
        grace = settings.HANGAR_PREEMPT_GRACE_SECONDS if preempted else settings.HANGAR_KILL_GRACE_SECONDS
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
        reason = describe_exit(returncode) + abort_hint(returncode, self.world_size)
        self.system(reason, error=True)
        return Outcome(AttemptState.FAILED, FailureClass.USER, reason), code

    def system(self, text: str, error: bool = False) -> None:
        self.writer.system(f"[hangar] {text}", error)


def rank_env(attempt: Attempt, rank: int, master_addr: str) -> dict[str, str]:
    """What torch.distributed (env://) and torchrun expect: one rank per node."""
    world, port = str(len(attempt.ranks)), str(settings.HANGAR_MASTER_PORT_BASE + attempt.pk % 1000)
    nproc = str(max(1, attempt.job.gpus_per_node))
    return {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": port,
        "WORLD_SIZE": world,
        "RANK": str(rank),
        "NODE_RANK": str(rank),
        "GROUP_RANK": str(rank),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "HANGAR_RANK": str(rank),
        # torchrun reads its options from PET_* when they are not on its command line.
        "PET_NNODES": world,
        "PET_NODE_RANK": str(rank),
        "PET_MASTER_ADDR": master_addr,
        "PET_MASTER_PORT": port,
        "PET_NPROC_PER_NODE": nproc,
    }


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


def abort_hint(returncode: int, world_size: int) -> str:
    """torch.distributed on gloo can abort (SIGABRT) at exit after the work is done
    when destroy_process_group() runs without a barrier first (see TRAPS.md)."""
    if world_size > 1 and returncode in (-signal.SIGABRT, 128 + signal.SIGABRT):
        return "; if the rank had finished its work, call dist.barrier() before dist.destroy_process_group()"
    return ""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name} (exit code {128 - returncode})"
    return f"exited with code {returncode}"
