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

import ctypes
import logging
import os
import queue
import resource
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.db.models import Exists, OuterRef
from django.utils import timezone

from agent import (
    connections,
    envcache,
    environments,
    helpers,
    network,
    pipelinecopy,
    reach,
    running,
    sandbox,
    snapshots,
    watch,
)
from agent import ray as raycluster
from agent.output import LogWriter
from agent.preflight import rendezvous_reachable, run_preflight, run_rendezvous
from agent.running import RUNNING
from agent.running import lock as _running_lock
from fleet.models import HealthEvent, Node
from fleet.preflight import Result
from fleet.preflight import record as record_checks
from jobs import diagnosing, jobspec, pipelines, secret_env, tracking
from jobs.models import (
    STARTED_ATTEMPT_STATES,
    Attempt,
    AttemptState,
    FailureClass,
    Launcher,
    PipelineStage,
    Stream,
    lease_from,
)
from portal import statements
from portal.models import volume_env_name

log = logging.getLogger("hangar.agent")

# Only these variables of the agent's own environment reach a job: the agent's
# database and broker credentials must not.
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL")

WATCH_SECONDS = 0.25
LINE_QUEUE_READS = 256  # pipe reads (each up to 64 KiB of lines) waiting to be parsed
CHECK_SECONDS = 0.5  # how soon a cancel or preemption reaches the process

# Secret values shorter than this are not masked in the logs: masking every "1" or "ab" would
# garble the output and hide nothing worth hiding.
MIN_MASKED_SECRET = 4
SECRET_MASK = b"***"

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec must not dlopen

# Waits for its stdin to reach end of file, then SIGKILLs the job's process group ($1).
# Only the agent holds the pipe's write end, so the kernel closes it when the agent dies,
# however it dies: the job's children die with it instead of running on unwatched.
REAPER_SCRIPT = 'read -r _; kill -9 "-$1" 2>/dev/null'  # dash's kill takes no --


def renew_every() -> float:
    """Seconds between lease renewals (a write): a sixth of the lease, between every check and 5 s."""
    return min(max(settings.HANGAR_LEASE_SECONDS / 6, CHECK_SECONDS), 5.0)


@statements.query
def attempt_to_run(pk: int):
    """The attempt with what its run reads: its job, node, project, environment and user, and
    whether the job runs a pipeline's stage (most do not: then the stage is not read again)."""
    related = ("job", "node", "job__project", "job__environment", "job__submitted_by")
    staged = Exists(PipelineStage.objects.filter(job_id=OuterRef("job_id"), reused=False))
    return Attempt.objects.select_related(*related).annotate(runs_a_stage=staged).filter(pk=pk)[:1]


@statements.update
def renew_if_running(pk: int, lease_expires_at: datetime):
    """Renew a started attempt's lease, unless a stop was asked of it."""
    running_on = {"state__in": STARTED_ATTEMPT_STATES, "cancel_requested_at": None, "preempt_requested_at": None}
    return Attempt.objects.filter(pk=pk, **running_on), {"lease_expires_at": lease_expires_at}


@statements.update
def renew_while_stopping(pk: int, lease_expires_at: datetime):
    """Renew a started attempt's lease while its process gets the grace period of a stop."""
    return Attempt.objects.filter(pk=pk, state__in=STARTED_ATTEMPT_STATES), {"lease_expires_at": lease_expires_at}


@statements.query
def stop_asked(pk: int):
    """An attempt's state and the stop asked of it, if any."""
    asked = ("state", "cancel_requested_at", "preempt_requested_at", "reason")
    return Attempt.objects.filter(pk=pk).values_list(*asked)[:1]


def run_attempt(attempt_id: int, rank: int = 0) -> None:
    """Entry point of the agent's Celery task: run one rank of an attempt."""
    close_old_connections()
    try:
        attempt = attempt_to_run.first(pk=attempt_id)
        if attempt is None or not attempt.begin(rank):
            log.info("attempt %s rank %s is taken or no longer current; nothing to run", attempt_id, rank)
            return
        runner = Runner(attempt, rank)
        with _running_lock:
            RUNNING[attempt.pk] = runner
        try:
            runner.run()
        finally:
            running.release(attempt.pk)
            watch.forget(attempt.pk)
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
        self.attempt = attempt
        self.job = attempt.job
        self.rank = rank
        placement = attempt.ranks[rank]
        self.node = (
            attempt.node if placement["node_id"] == attempt.node_id else Node.objects.get(pk=placement["node_id"])
        )
        self.gpus: list[int] = placement["gpus"]
        if not getattr(attempt, "runs_a_stage", True):
            pipelines.runs_no_stage(self.job)
        self.master = attempt.node  # rank 0's node: MASTER_ADDR for every rank
        # This runner's view of its attempt is its rank's placement: the agent's
        # telemetry, preflight and output monitoring read node and GPUs from it.
        # (Never saved: attempt rows change only through conditional updates.)
        attempt.gpu_indices = self.gpus
        attempt.node = self.node
        # Bounded: a job printing faster than the database stores is held to its pace
        # (its pipe fills) instead of the agent's memory growing with the backlog.
        self.lines: queue.Queue = queue.Queue(maxsize=LINE_QUEUE_READS)
        self.writer = LogWriter(attempt, self.lines, rank=rank, node_id=self.node.pk)
        self.proc: subprocess.Popen | None = None
        self.launch: sandbox.Launch | None = None
        self.reaper: subprocess.Popen | None = None
        self.keeping_lease: threading.Event | None = None
        self.stop_requested: Outcome | None = None
        self.current = True
        self.tracking: InBackground | None = None
        self.environment: envcache.Prepared | None = None  # its cached environment, held while it runs
        self.ray = self.job.launcher == Launcher.RAY
        self.ray_driver_started = False  # rank 0 of a Ray job: every node joined, the driver was let start
        self.sandbox_info: int | None = None  # the read end of bwrap's --info-fd, until job_group reads it
        self.view = reach.View(sandboxed=False, everything=True)  # what the job sees: set by start_process
        self.output: MaskedLines | None = None  # what the job prints, on its way to the writer
        self.exited_at: float | None = None  # when its process was seen to end (time.time())
        self.stopping = False  # the agent had asked it to stop (cancel, preemption, timeout, another rank)
        self.sandbox_group: int | None = None  # the sandbox's process group (its init's pid), once read

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
            self.stop_keeping_lease()
            self.stop_reaper()
            if self.sandbox_info is not None:
                os.close(self.sandbox_info)
            if self.job.code:
                snapshots.remove_copy(self.workdir())  # its process group is gone (terminate, exited)
            if self.environment is not None:
                self.environment.close()
            if self.ray:
                raycluster.clean_up(self.workdir(), self.ray_temp_dir())

    def run_rank(self) -> None:
        self.keep_lease()  # preflight and the start (MLflow's first run on a node) take seconds
        where = f"on node {self.node.name}, GPUs {self.gpu_list() or 'none'}"
        rank = f" rank {self.rank} of {self.world_size}" if self.world_size > 1 else ""
        self.system(f"attempt {self.attempt.number}{rank} {where}")
        outcome, exit_code = self.preflight_and_execute()
        # Its process group is gone: a rank waiting for these GPUs may start now, while this
        # one writes its outcome (the hand-off from one short job to the next).
        running.release(self.attempt.pk)
        last_exit = self.record_exit(exit_code)
        # A Ray job's outcome is its driver's (rank 0): the other ranks' Ray nodes never end by themselves.
        others_running = outcome.state == AttemptState.SUCCEEDED and self.current and self.world_size > 1
        others_running = others_running and not (self.ray and self.rank == 0)
        if others_running and not self.record(lambda: self.attempt.rank_succeeded(self.rank)):
            self.system(f"rank {self.rank} done; the attempt ends when every rank has")
            self.writer.close()  # the lease is kept meanwhile (keep_lease)
            return
        self.writer.close()  # the lease is kept meanwhile (keep_lease)
        ended = outcome.state, outcome.failure_class, outcome.reason, exit_code
        if not self.current:
            log.warning("attempt %s ended elsewhere or lost its lease; rank %s stopped", self.attempt.pk, self.rank)
        elif self.record(lambda: self.attempt.finish(*ended)):
            return  # its end diagnoses it (jobs/diagnosing.py), with every exit recorded so far
        else:
            log.warning("attempt %s was ended elsewhere; outcome %s dropped", self.attempt.pk, outcome.state)
        if last_exit:  # ended by another rank: diagnosed again with this one's exit and lines, now stored
            diagnosing.store(self.attempt.pk)

    def record_exit(self, exit_code: int | None) -> bool:
        """A failed rank of a multi-node attempt records its exit (code, time, whether the agent
        had stopped it) for the diagnosis, which orders ranks by it; True when it was the last
        rank's to record (the first diagnosis ran at the attempt's end, before it reported)."""
        if self.world_size == 1 or self.proc is None or exit_code in (None, 0) or self.exited_at is None:
            return False
        stopped = self.stopping
        return self.record(lambda: self.attempt.rank_exited(self.rank, exit_code, self.exited_at, stopped))

    def record(self, write: Callable[[], bool]) -> bool:
        """Write this rank's outcome, retrying while the database fails: an outcome lost
        after the process exited would let the lease expire and run a finished job again.
        The lease is renewed between tries; after one lease duration the error is raised."""
        deadline = time.monotonic() + settings.HANGAR_LEASE_SECONDS
        delay = 0.1
        while True:
            try:
                return write()
            except DatabaseError as exc:
                if time.monotonic() + delay > deadline:
                    raise
                log.warning("attempt %s: cannot record its outcome yet, retrying: %s", self.attempt.pk, exc)
                close_old_connections()  # a broken connection is closed and reopened by the next query
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def preflight_and_execute(self) -> tuple[Outcome, int | None]:
        if not self.wait_for_gpus():
            outcome = self.stop_requested or Outcome(
                AttemptState.LOST, FailureClass.INFRA, "the attempt ended while it waited for its GPUs"
            )
            return outcome, None
        # The job's MLflow run (tens of ms of store round trips) is made while the checks run.
        pipelines.stage_run_by(self.job)  # read once, here: the run's tags and the start both need it
        self.tracking = InBackground(lambda: tracking.job_env(self.job, self.attempt), "mlflow-run")
        failures = run_preflight(self.attempt, self.job.gpu_type)  # records each check; a failure cordons
        if not failures and self.world_size > 1:
            failures = self.rendezvous()
            if self.stop_requested is not None:
                return self.stop_requested, None
        if failures:
            reason = "preflight failed: " + "; ".join(failures)
            self.system(reason, error=True)
            return Outcome(AttemptState.FAILED, FailureClass.INFRA, reason), None
        if behind := self.checkpoint_left_behind():
            self.system(behind)
        if (unpacked := self.prepare_code()) is not None:
            return unpacked, None
        if (ended := self.prepare_environment()) is not None:
            return ended, None
        if self.ray and self.rank > 0 and (ended := self.wait_for_ray_head()) is not None:
            return ended, None
        try:
            self.proc = self.start_process()
        except pipelinecopy.CopyStopped:
            return self.stop_requested or Outcome(AttemptState.LOST, FailureClass.INFRA, "ended during its copy"), None
        except pipelinecopy.CopyRefused as exc:  # said in the log already
            return Outcome(AttemptState.FAILED, exc.failure_class, exc.reason), None
        except secret_env.SecretUnreadable as exc:  # this node's keys, not the job: infra
            reason = f"could not start the job: {exc}"
            self.system(reason, error=True)
            return Outcome(AttemptState.FAILED, FailureClass.INFRA, reason), None
        except LaunchRefused as exc:
            reason = f"could not start the job: {exc.problem.reason}"
            self.system(reason, error=True)
            failure = FailureClass.INFRA if exc.problem.nodes_fault else FailureClass.USER
            return Outcome(AttemptState.FAILED, failure, reason), 127
        except OSError as exc:
            # The program was checked (LaunchRefused): what fails here is the node's sandbox or launcher.
            where = f" ({exc.filename})" if exc.filename else ""
            reason = f"could not start the job: {exc.strerror or exc}{where}"
            self.system(reason, error=True)
            return Outcome(AttemptState.FAILED, FailureClass.INFRA, reason), None
        record = self.environment.record if self.environment is not None and self.rank == 0 else None
        if not self.attempt.mark_running(self.proc.pid, record):
            self.request_stop(AttemptState.CANCELLED, FailureClass.CANCELLED, "cancelled before start")
        if self.ray and self.rank == 0:
            threading.Thread(target=self.watch_ray_join, name="ray-join", daemon=True).start()
        return self.watch()

    def checkpoint_left_behind(self) -> str:
        """When checkpoints are per host and this rank's previous attempt ran on another node:
        its checkpoint directory stayed there, and this attempt starts without it."""
        if settings.HANGAR_CHECKPOINT_ROOT or self.attempt.number <= 1:
            return ""
        before = (
            Attempt.objects.filter(job_id=self.job.pk, number__lt=self.attempt.number, running_at__isnull=False)
            .order_by("-number")
            .first()
        )
        if before is None or self.rank >= len(before.ranks):
            return ""
        node_id = before.ranks[self.rank]["node_id"]
        if node_id == self.node.pk:
            return ""
        where = Node.objects.filter(pk=node_id).values_list("name", flat=True).first() or f"node {node_id}"
        return (
            f"attempt {before.number} ran rank {self.rank} on {where}; its checkpoint directory stayed there "
            f"(HANGAR_CHECKPOINT_ROOT is not set to storage the nodes share), so this attempt on {self.node.name} "
            "starts without it"
        )

    def prepare_environment(self) -> Outcome | None:
        """The job's cached Python environment (agent/envcache.py): built once on this node, then reused."""
        try:
            self.environment = envcache.prepare(self.job, self.system, self.still_current)
        except envcache.Stopped:
            return self.stop_requested or Outcome(AttemptState.LOST, FailureClass.INFRA, "ended during its build")
        except envcache.BuildFailed as exc:
            self.system(exc.reason, error=True)
            return Outcome(AttemptState.FAILED, exc.failure_class, exc.reason)
        return None

    def rendezvous(self) -> list[str]:
        """Multi-node preflight: this rank and rank 0 reach each other on the job's MASTER_PORT."""
        port = int(rank_env(self.attempt, self.rank, "")["MASTER_PORT"])
        return run_rendezvous(self.attempt, self.rank, self.world_size, self.master_addr(), port, self.still_current)

    def still_current(self) -> bool:
        """For waits before the process starts: sees a cancel or another rank's end (the
        keep_lease thread renews the lease meanwhile)."""
        self.poll_attempt(renew=False)
        return self.current and self.stop_requested is None

    def wait_for_gpus(self) -> bool:
        """Start only when no process of an earlier attempt on this agent still holds one of
        our GPUs. An ended attempt's rank can outlive its row's final state by its grace
        period (a preempted job writing its checkpoint); a new process must not share the
        GPU with it, nor read a checkpoint it is still writing. False if the attempt ended
        or was stopped meanwhile (keep_lease renews the lease while it waits)."""
        announced = False
        next_check = 0.0
        while True:
            with _running_lock:
                holders = self.gpu_holders()
                if holders and announced:
                    running.released.wait(WATCH_SECONDS)  # woken when a runner releases its GPUs
                    holders = self.gpu_holders()
            if not holders:
                return True
            if not announced:
                announced = True
                self.system(f"waiting for attempt {', '.join(map(str, holders))} to release GPUs {self.gpu_list()}")
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_SECONDS
                self.poll_attempt(renew=False)  # keep_lease renews it
                connections.hand_back()
            if self.stop_requested is not None or not self.current:
                return False

    def gpu_holders(self) -> list[int]:
        """Attempts of this agent whose process still holds one of our GPUs (call under the lock)."""
        return sorted(
            r.attempt.pk
            for r in RUNNING.values()
            if r is not self and r.proc is not None and set(r.gpus) & set(self.gpus)
        )

    def gpu_list(self) -> str:
        return ",".join(str(i) for i in self.gpus)

    def job_env(self) -> dict[str, str]:
        job, attempt = self.job, self.attempt
        env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
        first = [str(Path(reach.default_python()).parent)]  # the node's job Python is the job's `python`
        env["PATH"] = reach.job_path(os.environ.get("PATH", os.defpath), first, self.view)
        env["PYTHONUNBUFFERED"] = "1"  # live logs from Python jobs unless the job says otherwise
        # MLFLOW_*; the job's own env may override them. Begun during the preflight when there was one.
        env.update(self.tracking.result() if self.tracking is not None else tracking.job_env(job, attempt))
        if tracking.enabled() and (left_out := tracking.left_out(job)):
            self.system(left_out)
        if self.world_size > 1:  # the interface this node's ranks use; the job's own env may override it
            env.update(network.rank_network_env(self.node.network_interface))
        env.update({str(k): str(v) for k, v in job.env.items()})
        env.update(secret_env.process_env(job.secret_env))  # refuses a secret it cannot decrypt
        env.update({volume_env_name(v["name"]): v["path"] for v in job.volumes})
        env.update(
            CUDA_VISIBLE_DEVICES=self.gpu_list(),
            HANGAR_JOB_ID=str(job.pk),
            HANGAR_ATTEMPT=str(attempt.number),
            HANGAR_PROJECT=job.project.slug,
            HANGAR_NODE=self.node.name,
            HANGAR_CHECKPOINT_DIR=str(job.checkpoint_dir()),
            **pipelines.stage_env(job),  # HANGAR_PIPELINE_DIR of a pipeline's stage
            **self.rank_variables(),
        )
        # The submit refuses them; a job stored before it did must not hand them to root either.
        if unsafe := sorted(jobspec.ROOT_UNSAFE & env.keys()):
            self.system(f"not given to the job: {', '.join(unsafe)} ({jobspec.ROOT_UNSAFE_REASON})", error=True)
            env = {k: v for k, v in env.items() if k not in jobspec.ROOT_UNSAFE}
        return env

    def rank_variables(self) -> dict[str, str]:
        """torchrun's variables only where more than one process runs: scripts that enter DDP
        when RANK is set (nanoGPT, accelerate, Lightning) run a one-process job as they would
        alone. Under launcher torchrun, torchrun gives them to each process it starts."""
        if self.job.launcher == Launcher.TORCHRUN:
            return {"HANGAR_RANK": str(self.rank)} if self.world_size > 1 else {}
        if self.world_size == 1:
            return {}
        return rank_env(self.attempt, self.rank, self.master_addr())

    def master_addr(self) -> str:
        if self.world_size == 1:
            return "127.0.0.1"
        return self.master.address or self.master.hostname or self.master.name

    def workdir(self) -> Path:
        """The job's directory; with a code snapshot, each rank of each attempt has its own
        copy of the code in it (next to the checkpoint directory they share)."""
        jobdir = settings.HANGAR_JOB_WORKDIR / str(self.job.pk)
        return jobdir / f"code-{self.attempt.number}-{self.rank}" if self.job.code else jobdir

    def prepare_code(self) -> Outcome | None:
        """A job submitted with --code runs in a fresh copy of its snapshot (agent/snapshots.py);
        the Outcome when that cannot be made: the snapshot gone (the user's to send again) or
        this node unable to unpack it (infra: another node may)."""
        if not self.job.code:
            return None
        sha = self.job.code["snapshot"]
        try:
            snapshots.fresh_copy(self.job, self.workdir())
        except snapshots.CodeUnavailable as exc:
            self.system(str(exc), error=True)
            return Outcome(AttemptState.FAILED, FailureClass.USER, str(exc))
        except OSError as exc:
            reason = f"could not unpack code snapshot {sha[:12]} on node {self.node.name}: {exc}"
            self.system(reason, error=True)
            return Outcome(AttemptState.FAILED, FailureClass.INFRA, reason)
        self.system(f"running in a fresh copy of code snapshot {sha[:12]}")
        return None

    def start_process(self) -> subprocess.Popen:
        container = environments.is_container(self.job)
        # The job's own uid (and bubblewrap sandbox), or None: the node isolates nothing (agent/sandbox.py).
        prefix = self.environment.path if self.environment is not None else None
        self.launch = sandbox.launch_for(
            self.job, self.gpus, self.workdir(), not self.node.simulated, container, prefix
        )
        self.view = sandbox.job_view(self.launch)
        user = environments.job_user() if self.launch is None else environments.uid_user(self.launch.uid)
        # A stage's run directory (a rerun's: copied here, as this stage's uid): agent/pipelinecopy.py.
        pipelinecopy.prepare_stage_directory(self.job, user, self.launch is not None, self.system, self.still_current)
        if self.launch is None:
            environments.prepare_workdir(self.workdir(), self.job.checkpoint_dir(), user)
        argv, env = environments.command_for(
            self.job, self.job_env(), self.gpus, self.workdir(), f"hangar-{self.attempt.pk}-{self.rank}", user, prefix
        )
        if self.job.launcher == Launcher.TORCHRUN:
            argv = self.torchrun(argv)
        if not container and not self.ray:
            agent_path = os.environ.get("PATH", os.defpath)
            where = (self.node.name, str(self.workdir()))
            if problem := reach.program_problem(argv, env.get("PATH", ""), agent_path, self.view, *where):
                raise LaunchRefused(problem)
        if self.ray:
            argv, env = self.ray_rank(argv, env)
        boxed = self.launch is not None and self.launch.box is not None and not container
        info = os.pipe() if boxed else None  # bwrap's --info-fd: its init's pid (job_group)
        try:
            if self.launch is not None and not container:
                argv, env = self.launch.wrap(argv, env, self.workdir(), info[1] if info else None)
            popen_user = environments.popen_user(self.job, user) if self.launch is None else self.launch.popen_user()
            popen_user = popen_user if not container else {}
            limit = settings.HANGAR_JOB_MEMORY_LIMIT_MB
            leader = sandbox.leader_argv(argv, popen_user, limit, sandbox.tools(), dies_with_parent=boxed)
            if leader is not None:
                spawn = {"args": leader}  # spawned with vfork (see leader_argv)
            else:  # preexec_fn runs after the switch to the job user: setuid would clear PDEATHSIG
                spawn = {"args": argv, "preexec_fn": job_preexec(limit), **popen_user}
            proc = subprocess.Popen(
                env=env,
                cwd=self.workdir(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group, so cancel reaches every child
                pass_fds=info[1:] if info else (),
                **spawn,
            )
        except BaseException:
            if info:
                os.close(info[0])
            raise
        finally:
            if info:
                os.close(info[1])  # bwrap's copy alone: the read end sees its end if it writes none
        self.sandbox_info = info[0] if info else None
        if self.launch is None or self.launch.box is None:
            # In a sandbox no reaper is needed: its processes live in a PID namespace of their
            # own, which ends with bwrap, and bwrap dies with this thread (--die-with-parent).
            self.reaper = start_reaper(proc.pid)
        self.output = MaskedLines(self.lines, list(self.job.secret_env.values()))
        self.writer.read_from([(proc.stdout, Stream.STDOUT), (proc.stderr, Stream.STDERR)], self.output)
        return proc

    def torchrun(self, command: list[str]) -> list[str]:
        """The command under torch.distributed.run: one process per GPU of this node (at least one)."""
        port = rank_env(self.attempt, self.rank, "")["MASTER_PORT"]
        nproc = max(1, len(self.gpus))
        return torchrun_argv(command, self.world_size, self.rank, nproc, self.master_addr(), port)

    def watch(self) -> tuple[Outcome, int | None]:
        self.stop_keeping_lease()  # this loop renews it while the process runs
        started = time.monotonic()
        deadline = started + self.job.max_runtime_seconds
        # The start (mark_running) renewed the lease a moment ago, and a stop asked since is a
        # check away at most: the first look is due then, not now (a job shorter than a check,
        # most short ones, is not looked at while it runs: one write less per job).
        next_check, next_renew = started + CHECK_SECONDS, started + renew_every()
        lease_ok_at = started
        while self.proc.poll() is None:
            now = time.monotonic()
            if self.stop_requested is None and now >= deadline:
                limit = self.job.max_runtime_seconds
                self.request_stop(AttemptState.FAILED, FailureClass.TIMEOUT, f"exceeded max runtime of {limit}s")
            if now >= next_check:
                next_check = now + CHECK_SECONDS
                renew = now >= next_renew
                if self.poll_attempt(renew):
                    lease_ok_at = now
                    if renew:
                        next_renew = now + renew_every()
                elif now - lease_ok_at > settings.HANGAR_LEASE_SECONDS:
                    self.current = False
            if self.stop_requested is not None or not self.current:
                return self.terminate()
            connections.hand_back()
            wait_for_exit(self.proc, WATCH_SECONDS)
        self.exited_at = time.time()
        code = self.proc.returncode
        return self.exited(code if self.launch is None else self.launch.returncode(code))

    def poll_attempt(self, renew: bool = True) -> bool:
        """Look for a cancel or preemption and, when `renew`, renew the lease. The renewal
        is one conditional write that matches only a started attempt nobody asked to stop;
        the row is read when it matches nothing, or when only looking. Returns whether the
        database answered (not whether the attempt is still current: see `self.current`)."""
        try:
            if renew and renew_if_running.update(pk=self.attempt.pk, lease_expires_at=lease_from(timezone.now())):
                return True
            row = stop_asked.first(pk=self.attempt.pk)
            if renew and row is not None and row[0] in STARTED_ATTEMPT_STATES:
                # Asked to stop: keep the lease while the process gets its grace period.
                renew_while_stopping.update(pk=self.attempt.pk, lease_expires_at=lease_from(timezone.now()))
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
        self.keep_lease()
        outcome = self.stop_requested or Outcome(
            AttemptState.LOST, FailureClass.INFRA, "the attempt ended elsewhere (another rank failed) or lost its lease"
        )
        preempted = outcome.failure_class == FailureClass.PREEMPTED
        grace = settings.HANGAR_PREEMPT_GRACE_SECONDS if preempted else settings.HANGAR_KILL_GRACE_SECONDS
        self.system(f"stopping: {outcome.reason} (SIGTERM, then SIGKILL after {grace:g}s)", error=True)
        self.stopping = True
        signal_group(self.job_group(), signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self.exited_at = time.time()
        self.kill()
        self.writer.wait_for_streams(timeout=5)
        return outcome, exit_status(self.proc.returncode)

    def job_group(self) -> int:
        """The process group a stop's SIGTERM goes to: the job's. In a sandbox, the one its init
        leads (bwrap --new-session), read once from bwrap's --info-fd: the outer bwrap's own
        group would end the sandbox at once, before the job's grace period (agent/sandbox.py)."""
        if self.sandbox_info is not None:
            self.sandbox_group = sandbox.init_pid(self.sandbox_info)
            os.close(self.sandbox_info)
            self.sandbox_info = None
        return self.sandbox_group or self.proc.pid

    def kill(self) -> None:
        """SIGKILL the job's group and the started process's (in a sandbox, the outer bwrap's)."""
        signal_group(self.job_group(), signal.SIGKILL)
        signal_group(self.proc.pid, signal.SIGKILL)

    def exited(self, returncode: int) -> tuple[Outcome, int | None]:
        self.keep_lease()
        # Children the command left behind belong to the job: end them too.
        signal_group(self.job_group(), signal.SIGTERM)
        if not self.writer.wait_for_streams(timeout=2):
            self.kill()
            self.writer.wait_for_streams(timeout=5)
        code = exit_status(returncode)
        if code == 0:
            self.system("exited with code 0")
            return Outcome(AttemptState.SUCCEEDED, "", "exited with code 0"), 0
        if (failed := self.sandbox_failure(code)) is not None:
            reason = f"could not start the job: the sandbox failed: {failed}"
            self.system(reason, error=True)
            return Outcome(AttemptState.FAILED, FailureClass.INFRA, reason), code
        reason = describe_exit(returncode) + abort_hint(returncode, self.world_size)
        if self.ray and (self.rank > 0 or not self.ray_driver_started):
            # A Ray node died under the driver, or the head before the driver started: the node's, not
            # the job's; unless its environment cannot run python or ray at all (126, 127), which no
            # other node would change.
            what = f"the Ray node of rank {self.rank}" if self.rank > 0 else "the Ray head (before the driver started)"
            reason = f"{what} {reason}{raycluster.exit_hint(code)}"
            self.system(reason, error=True)
            unrunnable = code in (126, 127)
            return Outcome(AttemptState.FAILED, FailureClass.USER if unrunnable else FailureClass.INFRA, reason), code
        self.system(reason, error=True)
        # A hardware fault can kill the process before the agent's stop reaches it: still infra.
        fault = HealthEvent.stopping_fault(self.attempt.pk, self.node.pk, self.gpus)
        if fault is not None:
            reason += f" after a health event on its GPUs: {fault.message}"
            return Outcome(AttemptState.FAILED, FailureClass.INFRA, reason), code
        return Outcome(AttemptState.FAILED, FailureClass.USER, reason), code

    def sandbox_failure(self, code: int) -> str | None:
        """bwrap's own error when it, not the job, failed (it exits 1 after saying why, before
        the command runs: a bind or an exec it could not make). A job that prints the same
        first only earns an infrastructure requeue, capped by HANGAR_MAX_REQUEUES."""
        if self.launch is None or self.launch.box is None or code != 1 or self.output is None:
            return None
        first = self.output.first
        if first is None or first[0] != Stream.STDERR or not first[1].startswith(b"bwrap: "):
            return None
        said = first[1].decode(errors="replace").strip()
        program = said.removeprefix("bwrap: execvp ").rsplit(": ", 1)[0] if said.startswith("bwrap: execvp ") else ""
        return None if program and reach.own_program(program, str(self.workdir())) else said

    # --- launcher: ray (agent/ray.py) ---------------------------------------------------------

    def ray_ports(self) -> raycluster.Ports:
        master_port = int(rank_env(self.attempt, self.rank, "")["MASTER_PORT"])
        base = settings.HANGAR_MASTER_PORT_BASE
        return raycluster.ports(master_port, base, settings.HANGAR_RAY_PORT_BASE, self.rank)

    def ray_token(self) -> str:
        return raycluster.auth_token(settings.SECRET_KEY, self.attempt.pk)

    def ray_temp_dir(self) -> str:
        return raycluster.temp_dir(self.attempt.pk, self.rank, self.ray_token())

    def ray_bin(self) -> Path | None:
        if self.environment is not None:
            return self.environment.path / "bin"
        path = self.job.environment.path if self.job.environment is not None else ""
        return Path(path) / "bin" if path else None

    def ray_rank(self, command: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """This rank's Ray node (and on rank 0 the driver after it), with the cluster's variables."""
        ports, head = self.ray_ports(), self.master_addr()
        node_addr = head if self.rank == 0 else (self.node.address or self.node.hostname or self.node.name)
        cpus = raycluster.cpu_share(os.cpu_count() or 1, len(self.gpus), self.node.gpu_count)
        start = raycluster.start_argv(self.rank, ports, head, node_addr, len(self.gpus), cpus, self.ray_temp_dir())
        what = "head" if self.rank == 0 else f"node joining {head}:{ports.gcs}"
        self.system(f"ray: starting the {what} ({cpus} CPUs, {len(self.gpus)} GPUs, GCS port {ports.gcs})")
        env = {**env, **raycluster.ray_env(self.ray_token(), head, ports)}
        return raycluster.rank_argv(self.rank, start, command), env

    def wait_for_ray_head(self) -> Outcome | None:
        """Ranks >= 1 start their Ray node once the head's GCS port answers (the head takes
        seconds to start). Rank 0 decides whether the cluster formed; this rank only gives up
        when the attempt ends, or long after rank 0 would have."""
        head, port = self.master_addr(), self.ray_ports().gcs
        deadline = time.monotonic() + settings.HANGAR_RAY_JOIN_SECONDS + 30
        while time.monotonic() < deadline:
            reached, evidence = rendezvous_reachable(head, port, timeout=1.0)
            if reached:
                return None
            if not self.still_current():
                return self.stop_requested or Outcome(AttemptState.LOST, FailureClass.INFRA, "ended before Ray")
            time.sleep(0.2)
        reason = f"ray: the head at {head}:{port} never answered: {evidence}"
        self.system(reason, error=True)
        return Outcome(AttemptState.FAILED, FailureClass.INFRA, reason)

    def watch_ray_join(self) -> None:
        """Rank 0: wait for every node to join, then let the driver start (the go file); a
        cluster that does not form in HANGAR_RAY_JOIN_SECONDS fails the attempt (infra) with
        the evidence recorded as the `ray-join` check, and a node blamed (fleet/rendezvous.py)."""
        try:
            self._watch_ray_join()
        except Exception:
            log.exception("attempt %s: the Ray join check failed", self.attempt.pk)
            self.request_stop(AttemptState.FAILED, FailureClass.INFRA, "the Ray join check failed (agent error)")
        finally:
            connection.close()

    def _watch_ray_join(self) -> None:
        env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
        env.update(raycluster.ray_env(self.ray_token(), self.master_addr(), self.ray_ports()))
        address, expected, limit = env["RAY_ADDRESS"], self.world_size, settings.HANGAR_RAY_JOIN_SECONDS
        start, watch, ranks = time.monotonic(), None, set()
        try:
            while True:
                if self.stop_requested is not None or not self.current or self.proc.poll() is not None:
                    return  # cancelled, ended elsewhere, or the head died (its exit is the outcome)
                if watch is None:  # the head's GCS first: a client made before it listens waits long
                    reached, evidence = rendezvous_reachable(self.master_addr(), self.ray_ports().gcs, 1.0)
                    seen, error = 0, "" if reached else evidence
                    if reached and not self.ray_closed():
                        return
                    if reached:
                        watch = raycluster.Watch(self.ray_bin(), env, address, self.as_job)
                    else:
                        time.sleep(0.2)
                else:
                    seen, ranks, error = watch.look(1.0)
                elapsed = time.monotonic() - start
                decision = raycluster.join_decision(seen, expected, elapsed, limit, error)
                if decision.done:
                    break
        finally:
            if watch is not None:
                watch.close()
        self.ray_joined(decision, address, ranks, elapsed)

    def ray_closed(self) -> bool:
        """Unless the cluster answers a call without its token (the job's own version check can be
        fooled by the job; this call cannot): then the attempt stops as the user's, before its driver."""
        status, evidence = raycluster.tokenless_status(self.master_addr(), self.ray_ports().gcs)
        if status is None:  # no answer it could read: the join's own wait decides; said for the operator
            log.warning("attempt %s: the Ray GCS's tokenless answer was unreadable: %s", self.attempt.pk, evidence)
        if status != 0:  # refused (UNAUTHENTICATED), or no answer
            return True
        minimum = raycluster.RAY_MINIMUM
        reason = f"ray: the cluster answered a call without its token ({evidence}); ask for ray>={minimum}"
        self.system(reason, error=True)
        self.request_stop(AttemptState.FAILED, FailureClass.USER, reason)
        return False

    def as_job(self, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str], dict]:
        """A helper that runs the job's own code (its environment's python, its ray) runs as this
        rank's process does: the job's uid, in its sandbox (raycluster.Confine)."""
        if self.launch is not None:
            argv, env = self.launch.wrap(argv, env, self.workdir())
            return argv, env, self.launch.popen_user()
        return argv, env, environments.popen_user(self.job, environments.job_user())

    def ray_joined(self, decision: raycluster.Join, address: str, ranks: set[int], elapsed: float) -> None:
        """Record the join check; then let the driver start, or fail the attempt (infra, requeued).
        No node is made a suspect: the join is what the job's own ray did and reported."""
        result = Result("ray-join", decision.passed, decision.evidence, elapsed * 1000)
        record_checks(self.node, [result], "preflight", self.attempt)
        if decision.passed:
            raycluster.signal_go(self.workdir())
            self.ray_driver_started = True
            self.system(f"ray: {decision.evidence}; starting the driver with RAY_ADDRESS={address}")
            return
        missing = [r for r in range(self.world_size) if r not in ranks]
        where = f"; missing: rank {', '.join(map(str, missing))}" if ranks and missing else ""
        reason = f"ray: the cluster did not form: {decision.evidence}{where}"
        self.system(reason, error=True)
        self.request_stop(AttemptState.FAILED, FailureClass.INFRA, reason)

    def keep_lease(self) -> None:
        """Outside the watch loop (preflight and start; after the exit, until the outcome is
        recorded) a thread renews the lease: those steps can wait on a busy database for
        longer than a lease, and a lapsed lease would end the attempt as lost and rerun it."""
        if self.keeping_lease is None:
            self.keeping_lease = threading.Event()
            helpers.start(self._renew_until, self.keeping_lease, name=f"lease-{self.attempt.pk}-{self.rank}")

    def _renew_until(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(renew_every()):
                self.poll_attempt(renew=True)
                connections.hand_back()
        finally:
            connection.close()

    def stop_keeping_lease(self) -> None:
        if self.keeping_lease is not None:
            self.keeping_lease.set()
            self.keeping_lease = None

    def stop_reaper(self) -> None:
        """The job's process group is gone (or this runner is giving up on it): the reaper
        must not outlive it, lest it SIGKILL a later group that reuses the id."""
        if self.reaper is not None:
            self.reaper.kill()
            self.reaper.wait()
            self.reaper.stdin.close()
            self.reaper = None

    def system(self, text: str, error: bool = False) -> None:
        self.writer.system(f"[hangar] {text}", error)


class LaunchRefused(Exception):
    """The job's program cannot start where it would run (agent/reach.py): nothing is started."""

    def __init__(self, problem: reach.Unstartable):
        super().__init__(problem.reason)
        self.problem = problem


def torchrun_argv(command: list[str], nnodes: int, node_rank: int, nproc: int, addr: str, port: str) -> list[str]:
    """torch.distributed.run from the job's own Python: `python train.py ARGS` becomes
    `python -m torch.distributed.run OPTIONS train.py ARGS` (also `python -m module`); any
    other command runs under --no-python with the Python first on the job's PATH."""
    options = [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--nproc-per-node={nproc}"]
    options += [f"--master-addr={addr}", f"--master-port={port}"]
    program = command[0] if command else ""
    script = len(command) > 1 and (not command[1].startswith("-") or command[1] == "-m")
    if os.path.basename(program).startswith("python"):
        if script:
            return [program, "-m", "torch.distributed.run", *options, *command[1:]]
        return [program, "-m", "torch.distributed.run", *options, "--no-python", *command]
    return ["python", "-m", "torch.distributed.run", *options, "--no-python", *command]


def job_preexec(memory_limit_mb: int) -> Callable[[], None]:
    """What the job's leader does between fork and exec: die with the runner's thread
    (PR_SET_PDEATHSIG; its children are the reaper's), and take the memory limit."""
    limit = memory_limit_mb * 1024 * 1024

    def preexec() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return preexec


def start_reaper(pgid: int) -> subprocess.Popen:
    """A shell that SIGKILLs the job's process group when this agent dies (see REAPER_SCRIPT)."""
    return subprocess.Popen(
        ["/bin/sh", "-c", REAPER_SCRIPT, "hangar-reaper", str(pgid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C meant for the agent's terminal does not reach it
    )


class MaskedLines:
    """The queue the pipe readers fill, with the job's secret values replaced by *** in
    every line before it is stored, pushed or parsed. A value split by the line length
    limit, or printed transformed (encoded, reversed), is not recognised."""

    def __init__(self, out: queue.Queue, secrets: list[str | None]):
        self.out = out
        values = {str(v).encode() for v in secrets if v is not None and len(str(v)) >= MIN_MASKED_SECRET}
        self.secrets = sorted(values, key=len, reverse=True)  # a secret inside a longer one: the longer first
        self.first: tuple[int, bytes] | None = None  # the first line of either stream, with its stream

    def put(self, item: tuple) -> None:
        """An item of read_lines: (stream, time, [(raw line, cut), ...] or None at the end, flag)."""
        stream, ts, lines, flag = item
        if lines and self.first is None:
            self.first = (stream, lines[0][0])
        if lines and self.secrets:
            lines = [(self.mask(raw), cut) for raw, cut in lines]
        self.out.put((stream, ts, lines, flag))

    def mask(self, raw: bytes) -> bytes:
        for secret in self.secrets:
            if secret in raw:
                raw = raw.replace(secret, SECRET_MASK)
        return raw


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


class InBackground:
    """A call run on a helper thread (agent/helpers.py; with its own database connection, closed
    after) while the caller goes on; `result()` waits for it and returns its value or raises its error."""

    def __init__(self, call: Callable[[], dict], name: str):
        self.done = threading.Event()
        self.value: dict = {}
        self.error: BaseException | None = None
        helpers.start(self._run, call, name=name)

    def _run(self, call: Callable[[], dict]) -> None:
        try:
            self.value = call()
        except BaseException as exc:  # raised to the caller by result()
            self.error = exc
        finally:
            connection.close()
            self.done.set()

    def result(self) -> dict:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


def wait_for_exit(proc: subprocess.Popen, timeout: float) -> None:
    """Up to `timeout` seconds, returning as soon as the process exits: the next job on its GPUs
    waits for this (a sleep between polls would add up to its length to every hand-off). A
    pidfd (Linux 5.3+) becomes readable at the exit; elsewhere Popen.wait polls."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfds here, or the process is gone already
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


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
