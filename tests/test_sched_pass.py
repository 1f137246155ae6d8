"""The scheduling pass on the database: gangs, preemption, retries, environments, submit rules."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from fleet.models import Node, NodeState
from jobs.models import Attempt, AttemptState, Environment, FailureClass, Job, JobEvent, JobState
from jobs.scheduler import schedule_pass
from tests.factories import api_client, make_attempt, make_job, make_node


@pytest.fixture
def dispatched(monkeypatch) -> list[tuple[int, str, int]]:
    sent: list[tuple[int, str, int]] = []
    monkeypatch.setattr(
        "jobs.scheduler.dispatch", lambda attempt_id, queue, rank=0: sent.append((attempt_id, queue, rank))
    )
    return sent


@pytest.fixture
def run_pass(django_capture_on_commit_callbacks, dispatched):
    def run():
        with django_capture_on_commit_callbacks(execute=True):
            return schedule_pass()

    return run


def test_a_two_node_job_gets_one_rank_per_node_and_a_message_each(project, owner, run_pass, dispatched):
    a, b = make_node("node-a", gpus=4), make_node("node-b", gpus=4)
    make_node("node-c", gpus=2)
    job = make_job(project, owner, nodes=2, gpus_per_node=4)

    run_pass()

    attempt = Attempt.objects.get(job=job)
    assert [(r["rank"], r["node"], r["gpus"]) for r in attempt.placement] == [
        (0, "node-a", [0, 1, 2, 3]),
        (1, "node-b", [0, 1, 2, 3]),
    ]
    assert (attempt.node, attempt.gpu_indices) == (a, [0, 1, 2, 3])
    assert sorted(dispatched) == [(attempt.pk, a.queue, 0), (attempt.pk, b.queue, 1)]


def test_a_gang_that_does_not_fit_takes_nothing(project, owner, run_pass, dispatched):
    make_node("node-a", gpus=4)
    make_node("node-b", gpus=2)
    gang = make_job(project, owner, nodes=2, gpus_per_node=4)

    assert run_pass() == []
    assert Job.objects.get(pk=gang.pk).state == JobState.QUEUED


def test_gpus_held_by_a_gangs_other_ranks_are_not_given_away(project, owner, run_pass):
    make_node("node-a", gpus=4)
    b = make_node("node-b", gpus=4)
    gang = make_job(project, owner, nodes=2, gpus_per_node=4)
    run_pass()
    single = make_job(project, owner, gpus_per_node=1)

    run_pass()

    assert Job.objects.get(pk=single.pk).state == JobState.QUEUED
    assert b.pk in [r["node_id"] for r in gang.attempts.get().placement]


def test_an_urgent_job_preempts_a_running_scavenger(project, owner, node, run_pass):
    victim = make_job(project, owner, gpus_per_node=4, priority="scavenger")
    attempt = make_attempt(victim, node, AttemptState.RUNNING, gpu_indices=[0, 1, 2, 3], running_at=timezone.now())
    urgent = make_job(project, owner, gpus_per_node=4, priority="urgent")

    run_pass()
    run_pass()  # asked once only

    attempt.refresh_from_db()
    assert attempt.preempt_requested_at is not None
    assert attempt.reason == f"preempted to make room for job {urgent.pk}"
    assert attempt.state == AttemptState.RUNNING  # its agent stops it: SIGTERM, grace, SIGKILL
    assert Job.objects.get(pk=urgent.pk).state == JobState.QUEUED
    assert JobEvent.objects.filter(job=victim, kind="preempt").count() == 1

    attempt.finish(AttemptState.PREEMPTED, FailureClass.PREEMPTED, attempt.reason, exit_code=143)
    run_pass()

    victim.refresh_from_db()
    assert (victim.state, victim.preemptions, victim.retries) == (JobState.QUEUED, 1, 0)
    assert Job.objects.get(pk=urgent.pk).state == JobState.SCHEDULED


def test_a_scheduled_victim_is_preempted_at_once(project, owner, node, run_pass):
    victim = make_job(project, owner, gpus_per_node=4, priority="low")
    attempt = make_attempt(victim, node, AttemptState.SCHEDULED, gpu_indices=[0, 1, 2, 3])
    urgent = make_job(project, owner, gpus_per_node=4, priority="urgent")

    run_pass()
    run_pass()

    attempt.refresh_from_db()
    assert (attempt.state, attempt.failure_class) == (AttemptState.PREEMPTED, FailureClass.PREEMPTED)
    assert Job.objects.get(pk=urgent.pk).state == JobState.SCHEDULED
    assert Job.objects.get(pk=victim.pk).state == JobState.QUEUED


def test_a_job_goes_only_to_nodes_with_its_environment(project, owner, run_pass):
    make_node("node-a", gpus=4)
    b = make_node("node-b", gpus=4)
    advertised = Environment.objects.create(name="torch1", path="/opt/envs/torch1")
    advertised.nodes.add(b)
    job = make_job(project, owner, environment=advertised)

    run_pass()

    assert job.attempts.get().node == b


def test_a_project_quota_marks_borrowed_attempts(project, owner, node, run_pass):
    project.gpu_quota = 1
    project.save()
    first, second = make_job(project, owner), make_job(project, owner)

    run_pass()

    assert [j.attempts.get().borrowed for j in (first, second)] == [False, True]


# --- retries -------------------------------------------------------------------------


def fail(job: Job, node, failure_class: str) -> Job:
    attempt = make_attempt(job, node, AttemptState.RUNNING)
    attempt.finish(AttemptState.FAILED, failure_class, "it failed", exit_code=1)
    job.refresh_from_db()
    return job


def test_a_user_failure_uses_the_retry_budget(project, owner, node):
    job = make_job(project, owner, max_retries=1)

    assert fail(job, node, FailureClass.USER).state == JobState.QUEUED
    assert job.retries == 1
    assert fail(job, node, FailureClass.USER).state == JobState.FAILED
    assert list(job.events.values_list("kind", flat=True)) == ["retry", "failed"]


def test_a_user_failure_without_retries_fails_the_job(project, owner, node):
    assert fail(make_job(project, owner), node, FailureClass.USER).state == JobState.FAILED


def test_infra_failures_requeue_without_using_retries_up_to_a_cap(project, owner, node, settings):
    settings.HANGAR_MAX_REQUEUES = 2
    job = make_job(project, owner)

    states = [fail(job, node, FailureClass.INFRA).state for _ in range(3)]

    assert states == [JobState.QUEUED, JobState.QUEUED, JobState.FAILED]
    assert (job.retries, job.requeues) == (0, 2)


def test_preemptions_requeue_up_to_a_cap(project, owner, node, settings):
    settings.HANGAR_MAX_PREEMPTIONS = 1
    job = make_job(project, owner, max_retries=3)

    states = [fail(job, node, FailureClass.PREEMPTED).state for _ in range(2)]

    assert states == [JobState.QUEUED, JobState.FAILED]
    assert (job.retries, job.preemptions) == (0, 1)


# --- submitting: classes, nodes, retries, environments --------------------------------


def submit(user, **fields):
    body = {"project": "vision", "command": ["true"], **fields}
    return api_client(user).post("/api/v1/jobs/", body, format="json")


def test_a_job_gets_its_projects_default_class(project, teammate, node):
    project.default_priority = "low"
    project.save()

    response = submit(teammate)

    assert response.status_code == 201, response.json()
    assert response.json()["priority"] == "low"


def test_a_member_may_not_ask_for_a_class_above_the_projects_ceiling(project, owner, teammate, node):
    refused = submit(teammate, priority="urgent")
    assert refused.status_code == 400
    assert "urgent needs a manager of vision" in refused.json()["message"]

    assert submit(owner, priority="urgent").status_code == 201  # a manager may


def test_a_multi_node_job_with_retries_and_an_environment_is_accepted(project, teammate, node):
    make_node("node-b", gpus=4)

    response = submit(teammate, nodes=2, gpus_per_node=2, max_retries=2, environment="ai", preemptible=True)

    assert response.status_code == 201, response.json()
    body = response.json()
    assert (body["nodes"], body["max_retries"], body["environment"], body["preemptible"]) == (2, 2, "ai", True)


def test_an_unknown_environment_is_refused_with_the_known_ones(project, teammate, node):
    response = submit(teammate, environment="tf1")

    assert response.status_code == 400
    assert "no environment 'tf1'; environments: ai, cuda" in response.json()["message"]


def test_a_project_limit_on_gpus_per_job_is_enforced_at_submit(project, teammate, node):
    project.max_gpus_per_job = 2
    project.save()

    response = submit(teammate, gpus_per_node=4)

    assert response.status_code == 400
    assert "allows at most 2 a job" in response.json()["message"]


def test_an_outsider_cannot_submit_to_the_project(project, other_project, outsider, node):
    response = submit(outsider)

    assert response.status_code == 400
    assert "no project 'vision' that you can submit to" in response.json()["message"]


def test_a_gang_whose_rank_never_started_is_ended_and_requeued(project, owner, settings):
    from datetime import timedelta

    from jobs.scheduler import reconcile

    a, b = make_node("node-a"), make_node("node-b")
    job = make_job(project, owner, nodes=2)
    long_ago = timezone.now() - timedelta(seconds=settings.HANGAR_START_TIMEOUT_SECONDS + 5)
    placement = [{"rank": 0, "node_id": a.pk, "gpus": [0]}, {"rank": 1, "node_id": b.pk, "gpus": [0]}]
    attempt = make_attempt(
        job, a, AttemptState.RUNNING, placement=placement, rank_status={"0": None}, started_at=long_ago,
        lease_expires_at=timezone.now() + timedelta(seconds=30),
    )  # fmt: skip

    reconcile()

    attempt.refresh_from_db()
    assert (attempt.state, attempt.failure_class) == (AttemptState.LOST, FailureClass.INFRA)
    assert "a rank was not started" in attempt.reason
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED


# --- the queue is read before the pass's locks --------------------------------------


def test_no_preemption_for_a_job_that_left_the_queue_after_it_was_read(project, owner, node, run_pass, monkeypatch):
    from jobs import scheduler

    victim = make_job(project, owner, gpus_per_node=4, priority="scavenger")
    attempt = make_attempt(victim, node, AttemptState.RUNNING, gpu_indices=[0, 1, 2, 3], running_at=timezone.now())
    urgent = make_job(project, owner, gpus_per_node=4, priority="urgent")
    read = scheduler.queued_jobs

    def read_then_cancelled(**how):
        queue = read(**how)
        urgent.cancel(owner, "cancelled while the pass read the queue")
        return queue

    monkeypatch.setattr(scheduler, "queued_jobs", read_then_cancelled)
    assert run_pass() == []

    attempt.refresh_from_db()
    assert attempt.preempt_requested_at is None
    assert not JobEvent.objects.filter(job=victim, kind="preempt").exists()
    assert Job.objects.get(pk=urgent.pk).state == JobState.CANCELLED


def test_a_job_placed_by_another_pass_after_the_read_is_not_placed_again(project, owner, run_pass, monkeypatch):
    from jobs import scheduler

    make_node("node-a", gpus=1)
    make_node("node-b", gpus=1)
    job = make_job(project, owner, gpus_per_node=1)
    read = scheduler.queued_jobs

    def read_then_placed_elsewhere(**how):
        queue = read(**how)
        monkeypatch.setattr(scheduler, "queued_jobs", read)
        assert len(run_pass()) == 1  # the other pass, between this one's read and its locks
        return queue

    monkeypatch.setattr(scheduler, "queued_jobs", read_then_placed_elsewhere)
    assert run_pass() == []
    assert Attempt.objects.filter(job=job).count() == 1


def test_a_pass_reads_environments_and_caches_only_for_a_job_that_asks(project, owner, node, run_pass):
    """A plan looks at nodes' environments for a job naming one, at their caches for one with
    requirements: a queue of neither (most) leaves both unread."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    def tables_read(**fields) -> str:
        make_job(project, owner, **fields)
        with CaptureQueriesContext(connection) as queries:
            (attempt,) = run_pass()
        attempt.finish(AttemptState.SUCCEEDED)  # its GPUs free for the next
        return " ".join(q["sql"] for q in queries.captured_queries)

    plain = tables_read()
    assert "everywhere" not in plain and "jobs_environment_nodes" not in plain
    assert "fleet_cachedenvironment" not in plain
    named = tables_read(environment=Environment.objects.create(name="torch1", everywhere=True))
    assert "everywhere" in named and "jobs_environment_nodes" in named and "fleet_cachedenvironment" not in named
    cached = tables_read(requirements=["numpy"], requirements_key="k" * 64)
    assert "fleet_cachedenvironment" in cached


def test_a_pass_asks_for_a_schedulable_node_and_the_queue_in_one_statement(project, owner, node, run_pass):
    """An idle fleet's pass (every finish on it asks for one) is one statement; on a cordoned
    fleet that statement has no rows, whatever is queued (PostgreSQL then reads no queue: the
    node half is a one-time filter of its plan), and a job waits until a node is back."""
    with CaptureQueriesContext(connection) as idle:
        assert run_pass() == []
    assert len(idle.captured_queries) == 1
    job = make_job(project, owner, gpus_per_node=1)
    node.cordon(None, "maintenance")
    with CaptureQueriesContext(connection) as cordoned:
        assert run_pass() == []
    assert len(cordoned.captured_queries) == 1
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
    Node.objects.filter(pk=node.pk).update(state=NodeState.READY)
    assert [a.job_id for a in run_pass()] == [job.pk]
