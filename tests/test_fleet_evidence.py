"""Cordons need evidence: a fault a job prints is a suspicion until the agent's re-check, the
driver, or jobs of several users corroborate it (fleet/health.py weigh_suspicion, fleet/corroboration.py)."""

import sys

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from agent import runner as execution
from agent import running, watch
from agent.node import Agent
from agent.watch import observe_output
from fleet.gpus import SimulatedProvider
from fleet.models import GPU, HealthCheck, HealthEvent, NodeState
from jobs import scheduler
from jobs.models import Attempt, AttemptState, FailureClass, JobState
from portal.models import AuditEvent
from tests.factories import make_attempt, make_job, make_node
from tests.test_fleet_agent import FakeRunner

XID_LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
NCCL_LINE = "host:1:2 [0] NCCL WARN Call to ibv_post_send failed: unhandled system error"


@pytest.fixture
def sim_agent(db):
    watch._seen_in_output.clear()
    agent = Agent("sim-1", SimulatedProvider("sim-1", "H100", 4), 5.0)
    agent.register()
    yield agent
    running.CURRENT = None


@pytest.fixture
def run_on(sim_agent):
    runners = []

    def start(project, user, node=None, gpus=(0,), **fields):
        job = make_job(project, user)
        attempt = make_attempt(job, node or sim_agent.node, AttemptState.RUNNING, gpu_indices=list(gpus), **fields)
        runner = FakeRunner(attempt)
        execution.RUNNING[attempt.pk] = runner
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        execution.RUNNING.pop(runner.attempt.pk, None)


def state(node) -> str:
    node.refresh_from_db()
    return node.state


@pytest.mark.parametrize("line", [XID_LINE, NCCL_LINE])
def test_a_line_a_job_prints_is_a_suspicion_that_leaves_the_node_ready(sim_agent, run_on, project, owner, line):
    runner = run_on(project, owner)

    observe_output(runner.attempt, line, rank=0, rank_seq=7)

    event = HealthEvent.objects.get()
    assert state(sim_agent.node) == NodeState.READY
    assert event.source == "output" and "suspected" in event.action
    assert "not cordoned: seen only in the job's output" in event.evidence["decision"]
    assert (event.evidence["attempt"], event.evidence["rank"], event.evidence["rank_seq"]) == (runner.attempt.pk, 0, 7)
    assert runner.stopped[:2] == (AttemptState.FAILED, FailureClass.INFRA)  # stopped and requeued, as before
    assert HealthCheck.objects.filter(suite="recheck", passed=True).exists()  # the agent re-checked the GPUs
    assert not AuditEvent.objects.filter(action="node.auto_cordon").exists()


def test_a_failing_recheck_of_the_gpus_corroborates_it_and_cordons(sim_agent, run_on, project, owner):
    runner = run_on(project, owner, gpus=(1,))
    sim_agent.provider.inject("ecc", 1)  # a real fault the heartbeat has not sampled yet

    observe_output(runner.attempt, XID_LINE)

    event = HealthEvent.objects.get()
    assert state(sim_agent.node) == NodeState.CORDONED
    assert "re-check failed" in event.evidence["decision"] and "ecc: GPU 1" in event.evidence["decision"]
    audit = AuditEvent.objects.get(action="node.auto_cordon")
    assert audit.detail["evidence"]["line"] == XID_LINE  # the cordon names both pieces of evidence
    assert audit.detail["evidence"]["recheck_failures"]


def test_the_drivers_own_report_corroborates_it(sim_agent, run_on, project, owner):
    runner = run_on(project, owner)
    HealthEvent.objects.create(
        node=sim_agent.node, gpu_index=0, kind="xid", xid=79, severity="critical", message="GPU 0: Xid 79"
    )

    observe_output(runner.attempt, XID_LINE)

    assert state(sim_agent.node) == NodeState.CORDONED
    assert "the driver reports: GPU 0: Xid 79" in HealthEvent.objects.filter(source="output").get().evidence["decision"]


def test_jobs_of_two_users_reporting_it_on_one_node_cordon_it(sim_agent, run_on, project, owner, teammate, settings):
    settings.HANGAR_CORROBORATION_USERS = 2
    first, again, second = run_on(project, owner), run_on(project, owner, gpus=(1,)), run_on(project, teammate)

    observe_output(first.attempt, NCCL_LINE)
    observe_output(again.attempt, NCCL_LINE)  # the same user's second job: still one user
    assert state(sim_agent.node) == NodeState.READY
    observe_output(second.attempt, NCCL_LINE)

    assert state(sim_agent.node) == NodeState.CORDONED
    event = HealthEvent.objects.filter(attempt=second.attempt).get()
    assert "jobs of 2 different users reported it here" in event.evidence["decision"]
    evidence = AuditEvent.objects.get(action="node.auto_cordon").detail["evidence"]
    assert {e["attempt"] for e in evidence["related_events"]} == {first.attempt.pk, again.attempt.pk}


def test_the_window_bounds_the_users_that_count(sim_agent, run_on, project, owner, teammate, settings):
    first = run_on(project, owner)
    observe_output(first.attempt, NCCL_LINE)
    HealthEvent.objects.update(at=HealthEvent.objects.get().at.replace(year=2000))

    observe_output(run_on(project, teammate).attempt, NCCL_LINE)

    assert state(sim_agent.node) == NodeState.READY


def test_a_fault_that_follows_the_job_to_another_node_does_not_stop_it_again(sim_agent, run_on, project, owner):
    elsewhere = make_node("node-z")
    first = run_on(project, owner, node=elsewhere)
    observe_output(first.attempt, XID_LINE)
    first.attempt.finish(AttemptState.FAILED, FailureClass.INFRA, "health: Xid 79 in the job's output")
    watch._seen_in_output.clear()
    second = FakeRunner(make_attempt(first.attempt.job, sim_agent.node, AttemptState.RUNNING, gpu_indices=[0]))
    execution.RUNNING[second.attempt.pk] = second
    try:
        observe_output(second.attempt, XID_LINE)
    finally:
        execution.RUNNING.pop(second.attempt.pk)

    event = HealthEvent.objects.filter(attempt=second.attempt).get()
    assert "follows the job, not the node" in event.evidence["decision"]
    assert second.stopped is None and state(sim_agent.node) == NodeState.READY


def test_a_multi_node_nccl_error_is_attributed_to_the_rank_that_reported_it_first(
    sim_agent, run_on, project, owner, teammate, settings
):
    settings.HANGAR_CORROBORATION_USERS = 1  # one user's report would cordon: attribution decides which node
    other = make_node("node-b")
    placement = [
        {"rank": 0, "node_id": other.pk, "node": "node-b", "gpus": [0]},
        {"rank": 1, "node_id": sim_agent.node.pk, "node": "sim-1", "gpus": [0]},
    ]
    runner = run_on(project, owner, node=other, placement=placement)
    observe_output(runner.attempt, NCCL_LINE, rank=0)
    watch._seen_in_output.clear()
    runner.attempt.node = sim_agent.node  # rank 1's view of the attempt, as its runner sets it

    observe_output(runner.attempt, NCCL_LINE, rank=1)

    assert state(other) == NodeState.CORDONED
    assert state(sim_agent.node) == NodeState.READY
    follow_on = HealthEvent.objects.get(node=sim_agent.node)
    assert "node-b" in follow_on.evidence["reported_first_on"]


def test_a_requeued_job_avoids_the_node_its_output_accused(project, owner, transactional_db):
    a, b = make_node("node-a", gpus=1), make_node("node-b", gpus=1)
    job = make_job(project, owner)
    attempt = make_attempt(job, a, AttemptState.RUNNING)
    HealthEvent.objects.create(node=a, attempt=attempt, kind="xid", xid=79, severity="critical", message="x",
                               source="output", action="suspected, job stopped")  # fmt: skip
    attempt.finish(AttemptState.FAILED, FailureClass.INFRA, "health: Xid 79 in the job's output")
    assert job.__class__.objects.get(pk=job.pk).state == JobState.QUEUED

    (placed,) = scheduler.schedule_pass()

    assert placed.node_id == b.pk


def test_a_pass_reads_suspicions_only_for_queued_jobs_that_ran_before(project, owner, transactional_db):
    a = make_node("node-a", gpus=1)
    fresh = [make_job(project, owner) for _ in range(3)]
    assert not any(scheduler.ran_before(j.retries, j.requeues, j.preemptions) for j in fresh)
    with CaptureQueriesContext(connection) as fresh_pass:
        scheduler.queued_jobs()
    # A fresh queue (most of one: jobs from their submit) cannot have a suspicion: no read of them.
    assert not any("healthevent" in q["sql"] for q in fresh_pass.captured_queries)

    job = fresh[0]
    attempt = make_attempt(job, a, AttemptState.RUNNING)
    HealthEvent.objects.create(node=a, attempt=attempt, kind="xid", xid=79, severity="critical", message="x",
                               source="output", action="suspected, job stopped")  # fmt: skip
    attempt.finish(AttemptState.FAILED, FailureClass.INFRA, "health: Xid 79 in the job's output")
    requeued = next(q for q in scheduler.queued_jobs() if q.job_id == job.pk)
    assert requeued.avoid == frozenset({a.pk})


def test_a_jobs_own_exit_after_printing_a_fake_xid_is_its_own_failure(transactional_db, project, owner):
    watch._seen_in_output.clear()
    running.CURRENT = None
    node = make_node("node-a", gpus=1)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())  # fresh telemetry for preflight
    code = f"import sys; print({XID_LINE!r}, flush=True); sys.exit(3)"
    make_job(project, owner, command=[sys.executable, "-c", code])
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)

    attempt = Attempt.objects.get(pk=attempt.pk)
    from jobs.models import LogLine

    assert attempt.exit_code == 3, list(LogLine.objects.values_list("text", flat=True))
    event = HealthEvent.objects.filter().first()
    assert event and "suspected" in event.action, list(LogLine.objects.values_list("text", flat=True))
    # Exited on its own (before any stop): the job's failure, not the node's, unless corroborated.
    assert attempt.failure_class == FailureClass.USER, attempt.reason


def test_the_drivers_report_after_a_suspicion_cordons_naming_both(sim_agent, run_on, project, owner):
    runner = run_on(project, owner)
    observe_output(runner.attempt, XID_LINE)
    assert state(sim_agent.node) == NodeState.READY

    sim_agent.provider.inject("xid", 0, 79)
    sim_agent.report()

    assert state(sim_agent.node) == NodeState.CORDONED
    assert "GPU 0: Xid 79" in sim_agent.node.state_reason
    assert "also Xid 79 in the job's output (output" in sim_agent.node.state_reason
    evidence = AuditEvent.objects.get(action="node.auto_cordon").detail["evidence"]
    assert evidence["source"] == "telemetry" and evidence["related_events"][0]["line"] == XID_LINE


def test_evidence_from_before_the_node_returned_to_service_does_not_count(sim_agent, run_on, project, owner):
    HealthEvent.objects.create(
        node=sim_agent.node, gpu_index=0, kind="xid", xid=79, severity="critical", message="GPU 0: Xid 79"
    )
    sim_agent.node.cordon(None, "by hand")
    sim_agent.node.uncordon(None, "burn-in passed")  # after the Xid: it was dealt with

    observe_output(run_on(project, owner).attempt, XID_LINE)

    assert state(sim_agent.node) == NodeState.READY


def test_printed_xids_do_not_count_towards_the_drivers_trend(sim_agent, run_on, project, owner, settings):
    settings.HANGAR_XID_STORM_SECONDS = 0
    from fleet.health import Finding
    from fleet.models import XidPolicy

    XidPolicy.objects.filter(xid=94).update(threshold=2)
    for user_job in range(2):
        watch._seen_in_output.clear()
        observe_output(run_on(project, owner, gpus=(user_job,)).attempt, "NVRM: Xid (PCI:0000:3b:00): 94, contained")

    HealthEvent.record(sim_agent.node, Finding("xid", "critical", "GPU 0: Xid 94", gpu_index=0, xid=94))

    assert state(sim_agent.node) == NodeState.READY  # one driver report of a trend Xid: below its threshold
