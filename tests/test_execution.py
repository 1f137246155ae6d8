"""The agent's Runner: handing GPUs over between attempts, and how a rank learns that it must stop."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.utils import timezone

from agent import runner as execution
from agent import running
from fleet.models import GPU
from jobs import scheduler
from jobs.models import Attempt, AttemptState, FailureClass, JobState, LogLine
from tests.factories import make_attempt, make_job
from tests.factories import make_node as make_bare_node


@pytest.fixture(autouse=True)
def no_agent_in_this_process():
    running.CURRENT = None
    yield
    running.CURRENT = None


def make_node(name: str, gpus: int):
    """A node whose GPUs just reported healthy telemetry, so preflight passes."""
    node = make_bare_node(name, gpus=gpus)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    return node


class StoppingRank:
    """What RUNNING holds for a rank of an ended attempt whose process is still in its grace period."""

    def __init__(self, attempt: Attempt, gpus: list[int]):
        self.attempt, self.gpus, self.proc = attempt, gpus, object()


def test_a_new_rank_waits_until_the_previous_attempts_process_releases_its_gpus(transactional_db, project, owner):
    node = make_node("node-a", gpus=2)
    old = make_attempt(make_job(project, owner), node, AttemptState.PREEMPTED, gpu_indices=[0, 1])
    execution.RUNNING[old.pk] = StoppingRank(old, [0, 1])
    job = make_job(project, owner, command=[sys.executable, "-c", "import time; print(f'started {time.time():.6f}')"])
    (attempt,) = scheduler.schedule_pass()
    released_at = []

    def release():
        time.sleep(1.5)
        released_at.append(time.time())
        execution.RUNNING.pop(old.pk)

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        execution.run_attempt(attempt.pk)
    finally:
        releaser.join()
        execution.RUNNING.pop(old.pk, None)

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, attempt.reason
    texts = list(LogLine.objects.filter(attempt=attempt).order_by("seq").values_list("text", flat=True))
    assert f"[hangar] waiting for attempt {old.pk} to release GPUs 0" in texts
    (started,) = [float(t.split()[1]) for t in texts if t.startswith("started ")]
    assert started > released_at[0]  # the command started only once the GPUs were free


def test_a_rank_on_other_gpus_does_not_wait(transactional_db, project, owner):
    node = make_node("node-a", gpus=2)
    old = make_attempt(make_job(project, owner), node, AttemptState.RUNNING, gpu_indices=[1])
    execution.RUNNING[old.pk] = StoppingRank(old, [1])
    try:
        job = make_job(project, owner, command=[sys.executable, "-c", "print('hi')"])
        (attempt,) = scheduler.schedule_pass()
        assert attempt.gpu_indices == [0]
        execution.run_attempt(attempt.pk)
    finally:
        execution.RUNNING.pop(old.pk, None)
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert not LogLine.objects.filter(attempt=attempt, text__contains="waiting for attempt").exists()


def runner_for(attempt: Attempt) -> execution.Runner:
    attempt = Attempt.objects.select_related("job", "node").get(pk=attempt.pk)
    return execution.Runner(attempt)


def test_a_rank_that_finds_its_attempt_already_preempted_stops_as_preempted(db, project, owner, node):
    attempt = make_attempt(make_job(project, owner), node, AttemptState.RUNNING)
    runner = runner_for(attempt)
    # Another rank got the SIGTERM first, exited, and ended the attempt.
    Attempt.objects.filter(pk=attempt.pk).update(
        preempt_requested_at=timezone.now(), state=AttemptState.PREEMPTED, reason="preempted to make room for job 9"
    )

    assert runner.poll_attempt(renew=True)

    assert runner.current is False
    assert (runner.stop_requested.state, runner.stop_requested.failure_class) == (
        AttemptState.PREEMPTED,
        FailureClass.PREEMPTED,
    )
    assert runner.stop_requested.reason == "preempted to make room for job 9"


def test_a_renewal_extends_the_lease_also_while_a_cancelled_process_gets_its_grace(db, project, owner, node):
    attempt = make_attempt(make_job(project, owner), node, AttemptState.RUNNING)
    Attempt.objects.filter(pk=attempt.pk).update(lease_expires_at=timezone.now())
    runner = runner_for(attempt)

    assert runner.poll_attempt(renew=True) and runner.stop_requested is None and runner.current
    renewed = Attempt.objects.get(pk=attempt.pk).lease_expires_at
    assert renewed > timezone.now()

    Attempt.objects.filter(pk=attempt.pk).update(cancel_requested_at=timezone.now(), lease_expires_at=timezone.now())
    assert runner.poll_attempt(renew=True)
    assert runner.current  # still current: it ends when its process has
    assert runner.stop_requested.state == AttemptState.CANCELLED
    assert Attempt.objects.get(pk=attempt.pk).lease_expires_at > timezone.now()


def test_a_look_without_renewal_writes_nothing(db, project, owner, node):
    attempt = make_attempt(make_job(project, owner), node, AttemptState.RUNNING)
    Attempt.objects.filter(pk=attempt.pk).update(lease_expires_at=None)
    runner = runner_for(attempt)

    assert runner.poll_attempt(renew=False) and runner.current and runner.stop_requested is None
    assert Attempt.objects.get(pk=attempt.pk).lease_expires_at is None


def test_an_outcome_is_recorded_when_the_database_fails_at_first(transactional_db, project, owner, monkeypatch):
    """The command exited 0, then the first writes of its outcome hit a database error: the
    runner retries instead of leaving the attempt to its lease (which would run it again)."""
    from django.db import OperationalError

    make_node("node-a", gpus=1)
    job = make_job(project, owner, command=[sys.executable, "-c", "print('done')"])
    (attempt,) = scheduler.schedule_pass()
    real_finish, calls = Attempt.finish, []

    def finish_after_two_failures(self, *args, **kwargs):
        # A test double for the database edge: the first two writes fail as a dropped connection would.
        calls.append(args[0])
        if len(calls) <= 2:
            raise OperationalError("server closed the connection unexpectedly")
        return real_finish(self, *args, **kwargs)

    monkeypatch.setattr(Attempt, "finish", finish_after_two_failures)
    execution.run_attempt(attempt.pk)

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert calls == [AttemptState.SUCCEEDED] * 3
    assert (attempt.state, job.state, job.attempts.count()) == (AttemptState.SUCCEEDED, JobState.SUCCEEDED, 1)


def test_a_secret_value_printed_by_the_job_is_stored_masked(transactional_db, project, owner):
    make_node("node-a", gpus=1)
    code = "import os; print('token is', os.environ['API_TOKEN'], 'and pin', os.environ['PIN'])"
    job = make_job(
        project, owner, command=[sys.executable, "-c", code], secret_env={"API_TOKEN": "s3cr3t-v4lue", "PIN": "42"}
    )
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    texts = list(LogLine.objects.filter(attempt=attempt).values_list("text", flat=True))
    assert "token is *** and pin 42" in texts  # values shorter than MIN_MASKED_SECRET are left alone
    assert not any("s3cr3t-v4lue" in t for t in texts)


def test_the_reaper_kills_the_jobs_process_group_when_its_agents_pipe_closes():
    import subprocess

    job = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30"], start_new_session=True)
    reaper = execution.start_reaper(job.pid)
    reaper.stdin.close()  # what the kernel does when the agent dies

    assert reaper.wait(timeout=10) == 0
    assert job.wait(timeout=10) == -9
    # The background sleep, which PDEATHSIG would not reach, is gone too: at once on a quiet machine;
    # on a loaded one a SIGKILLed process may wait to be scheduled before it ends (0.2 s flaked).
    deadline = time.monotonic() + 10
    while running_in_group(job.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running_in_group(job.pid) == []


def running_in_group(pgid: int) -> list[int]:
    """Processes of a group that are not zombies (this container's init may not reap them)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def test_the_job_is_spawned_without_forking_the_agent(transactional_db, project, owner, settings, monkeypatch):
    """No preexec function and no uid for Popen (so it uses vfork): the memory limit and the
    parent-death signal come from prlimit and setpriv in the argv (agent/sandbox.leader_argv)."""
    settings.HANGAR_JOB_MEMORY_LIMIT_MB = 2048
    make_node("node-a", gpus=1)
    job = make_job(project, owner, command=["sh", "-c", "ulimit -v"])
    spawned = []
    popen = subprocess.Popen

    def recording(*args, **kwargs):
        if kwargs.get("stdout") is subprocess.PIPE and kwargs.get("stderr") is subprocess.PIPE:
            spawned.append(kwargs)
        return popen(*args, **kwargs)

    monkeypatch.setattr(execution.subprocess, "Popen", recording)
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    (kwargs,) = spawned
    assert not {"preexec_fn", "user", "group", "extra_groups"} & set(kwargs)
    assert Path(kwargs["args"][0]).name in ("prlimit", "setpriv")
    texts = list(LogLine.objects.filter(attempt=attempt).values_list("text", flat=True))
    assert str(2048 * 1024) in texts  # RLIMIT_AS in KiB, as the job saw it


def test_a_stored_job_never_hands_the_loaders_variables_to_what_the_agent_runs_as_root(
    transactional_db, project, owner, tmp_path
):
    """The submit refuses them (jobs/jobspec.ROOT_UNSAFE); a job stored before it did still runs,
    without them: LD_DEBUG_OUTPUT would have every program of its start, root's included, write
    the file it names."""
    make_node("node-a", gpus=1)
    trace = tmp_path / "trace"
    env = {"LD_DEBUG": "libs", "LD_DEBUG_OUTPUT": str(trace), "SEED": "7"}
    job = make_job(project, owner, command=["sh", "-c", 'echo "seed=$SEED debug=${LD_DEBUG:-none}"'], env=env)
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    texts = list(LogLine.objects.filter(attempt=attempt).values_list("text", flat=True))
    assert "seed=7 debug=none" in texts
    assert any(t.startswith("[hangar] not given to the job: LD_DEBUG, LD_DEBUG_OUTPUT") for t in texts)
    assert list(tmp_path.glob("trace*")) == []  # nothing wrote the file it named


def test_a_job_shorter_than_a_check_is_not_looked_at_while_it_runs(transactional_db, project, owner, monkeypatch):
    """Its start renewed the lease: the watch's first look (a read, or the renewal's write) is
    a check's time after it, and a job that ends before then needs none."""
    make_node("node-a", gpus=1)
    make_job(project, owner, command=["sleep", "0.1"])
    (attempt,) = scheduler.schedule_pass()
    looks_while_running = []
    poll = execution.Runner.poll_attempt

    def counted(runner, renew=True):
        if runner.proc is not None and runner.proc.poll() is None:
            looks_while_running.append(renew)
        return poll(runner, renew)

    monkeypatch.setattr(execution.Runner, "poll_attempt", counted)

    execution.run_attempt(attempt.pk)

    attempt.refresh_from_db()
    assert attempt.state == AttemptState.SUCCEEDED
    assert looks_while_running == []


def test_a_cancel_asked_before_the_process_started_stops_it_within_a_check(
    transactional_db, project, owner, monkeypatch
):
    make_node("node-a", gpus=1)
    job = make_job(project, owner, command=["sleep", "30"])
    (attempt,) = scheduler.schedule_pass()
    started = time.monotonic()
    original = execution.Runner.start_process

    def start_then_cancel(runner):
        proc = original(runner)
        Attempt.objects.filter(pk=attempt.pk).update(cancel_requested_at=timezone.now())  # asked during the start
        return proc

    monkeypatch.setattr(execution.Runner, "start_process", start_then_cancel)
    execution.run_attempt(attempt.pk)

    attempt.refresh_from_db()
    job.refresh_from_db()
    assert (attempt.state, job.state) == (AttemptState.CANCELLED, JobState.CANCELLED)
    assert time.monotonic() - started < 15  # far from the job's 30 s: the first check caught it
