"""The steps of a GPU's hand-off from one attempt to the next that need no stack: the runner sees
its process exit at once, and an attempt's end wakes the scheduler before anything else runs after
its commit (bench/throughput.py measures the whole hand-off)."""

import subprocess
import time

from agent.runner import wait_for_exit
from jobs.models import AttemptState
from portal import wakeup
from tests.factories import make_attempt, make_job, make_node


def test_the_wait_ends_when_the_process_exits_not_at_the_end_of_the_timeout():
    proc = subprocess.Popen(["sleep", "0.1"])
    start = time.monotonic()
    wait_for_exit(proc, 30)
    waited = time.monotonic() - start
    assert proc.poll() == 0
    assert waited < 10  # loose: returned at the exit, not after the 30 s timeout


def test_the_wait_returns_after_the_timeout_while_the_process_runs():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        wait_for_exit(proc, 0.05)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_an_attempts_end_wakes_the_scheduler_first_after_its_commit(
    db, project, owner, django_capture_on_commit_callbacks
):
    attempt = make_attempt(make_job(project, owner), make_node(), AttemptState.RUNNING)
    with django_capture_on_commit_callbacks() as callbacks:
        assert attempt.finish(AttemptState.FAILED, "user", "exited with code 1", exit_code=1)
    # The MLflow run's end and the diagnosis come after: they must not hold the freed GPUs back.
    assert len(callbacks) >= 2 and callbacks[0] is wakeup.send_pass_request
