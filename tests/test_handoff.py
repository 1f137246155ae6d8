"""The steps of a GPU's hand-off from one attempt to the next that need no stack: the runner sees
its process exit at once, and an attempt's end wakes the scheduler before anything else runs after
its commit (bench/throughput.py measures the whole hand-off)."""

import subprocess
import time

from agent.runner import wait_for_exit
from jobs.models import Attempt, AttemptState, Job, JobState
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
    # The job failed for good: only the fleet changed (its GPUs freed), not the queue.
    assert len(callbacks) >= 2 and callbacks[0] is wakeup.send_fleet_pass_request


def test_the_first_rank_taken_is_two_conditional_writes_with_no_read(db, project, owner, django_assert_num_queries):
    attempt = make_attempt(make_job(project, owner), make_node(), AttemptState.SCHEDULED)
    with django_assert_num_queries(4) as captured:  # a savepoint, the attempt's write, the job's, the release
        assert attempt.begin(0)
    assert not any(q["sql"].startswith("SELECT") for q in captured.captured_queries)
    attempt.refresh_from_db()
    assert (attempt.state, attempt.rank_status, attempt.started_at is not None) == ("preflight", {"0": None}, True)
    assert Job.objects.get(pk=attempt.job_id).state == JobState.PREFLIGHT
    assert not attempt.begin(0)  # taken: a redelivered message runs nothing


def test_a_later_rank_joins_the_ranks_taken_before_it(db, project, owner):
    a, b = make_node("node-a"), make_node("node-b")
    job = make_job(project, owner, nodes=2)
    placement = [{"rank": 0, "node_id": a.pk, "node": "node-a", "gpus": [0]}]
    placement.append({"rank": 1, "node_id": b.pk, "node": "node-b", "gpus": [0]})
    attempt = make_attempt(job, a, AttemptState.SCHEDULED, placement=placement)
    assert Attempt.objects.get(pk=attempt.pk).begin(1)
    assert Attempt.objects.get(pk=attempt.pk).begin(0)
    assert not Attempt.objects.get(pk=attempt.pk).begin(1)
    attempt.refresh_from_db()
    assert attempt.state == "preflight" and attempt.rank_status == {"0": None, "1": None}


def test_an_attempt_read_by_its_id_does_not_join_its_jobs_table(db, project, owner):
    """Ordered through the relation, every unordered read of attempts joined the jobs' table for
    the job's own ordering, and a locked read (an agent's start, a log batch's fence) locked the
    job's row too."""
    attempt = make_attempt(make_job(project, owner), make_node(), AttemptState.RUNNING)
    locked = Attempt.objects.select_for_update().filter(pk=attempt.pk).values_list("job_id", flat=True)
    assert "jobs_job" not in str(locked[:1].query)
    assert list(Attempt.objects.filter(job__project=project).values_list("number", flat=True)) == [1]
