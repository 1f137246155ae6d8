"""Multi-node preflight: every rank reaches rank 0 on the rendezvous port before the command starts."""

import socket
import sys
import threading

import pytest
from django.utils import timezone

from agent import preflight, running
from agent import runner as execution
from fleet import rendezvous
from fleet.models import GPU, HealthCheck, HealthEvent, NodeState
from jobs import scheduler
from jobs.models import Attempt, AttemptState, FailureClass, JobState
from tests.factories import make_job, make_node


@pytest.fixture(autouse=True)
def no_agent_in_this_process():
    running.CURRENT = None
    yield
    running.CURRENT = None


def healthy_node(name: str):
    # rank 0's hostname is MASTER_ADDR: two local agents on one machine, as in tests/test_sched_e2e.py
    node = make_node(name, gpus=1, hostname="127.0.0.1")
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    return node


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_rank_attempt(transactional_db, project, owner, settings):
    a, b = healthy_node("node-a"), healthy_node("node-b")
    job = make_job(project, owner, command=[sys.executable, "-c", "print('rank up')"], nodes=2, gpus_per_node=1)
    (attempt,) = scheduler.schedule_pass()
    assert [r["node"] for r in attempt.ranks] == ["node-a", "node-b"]
    settings.HANGAR_MASTER_PORT_BASE = free_port() - attempt.pk % 1000  # MASTER_PORT: a free port
    return job, attempt, a, b


def run_ranks(attempt, ranks) -> None:
    threads = [threading.Thread(target=execution.run_attempt, args=(attempt.pk, r)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)


def test_the_ranks_reach_rank_zero_before_the_command_starts(two_rank_attempt):
    job, attempt, a, b = two_rank_attempt

    run_ranks(attempt, [1, 0])  # rank 1 may come first: it retries until rank 0 listens

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, attempt.reason
    checks = {c.node.name: c for c in HealthCheck.objects.filter(attempt=attempt, name="rendezvous")}
    assert checks["node-b"].passed and "rank 0 answered" in checks["node-b"].evidence
    assert checks["node-a"].passed and "ranks [1] reached it" in checks["node-a"].evidence
    assert all(c.duration_ms > 0 for c in checks.values())


def test_rank_zero_unreachable_makes_rank_zeros_node_the_suspect_and_requeues_the_job(two_rank_attempt, settings):
    settings.HANGAR_RENDEZVOUS_SECONDS = 1.0
    job, attempt, a, b = two_rank_attempt

    run_ranks(attempt, [1])  # rank 0's agent never listens

    job.refresh_from_db()
    attempt.refresh_from_db()
    a.refresh_from_db()
    b.refresh_from_db()
    assert (attempt.state, attempt.failure_class) == (AttemptState.FAILED, FailureClass.INFRA)
    assert (
        "rendezvous" in attempt.reason and "unreachable" in attempt.reason and "suspect: node node-a" in attempt.reason
    )
    assert job.state == JobState.QUEUED and job.retries == 0  # requeued without using a retry
    check = HealthCheck.objects.get(attempt=attempt, name="rendezvous")
    assert (check.node, check.passed) == (b, False) and "127.0.0.1:" in check.evidence
    assert Attempt.objects.get(pk=attempt.pk).running_at is None  # the command never started
    # Rank 0 was unreachable from every other rank: its node is the suspect, not the reporting rank's.
    event = HealthEvent.objects.get(kind="rendezvous")
    assert (event.node, event.source, event.action) == (a, "preflight", "suspected")
    assert event.evidence["reported_by"] == "node-b" and event.evidence["points_at"] == "rank 0's node"
    # One suspicion is not a cordon: neither node left service.
    assert (a.state, b.state) == (NodeState.READY, NodeState.READY)


def test_a_second_attempt_pointing_at_the_same_node_cordons_it_and_the_queue_says_why(two_rank_attempt, settings):
    settings.HANGAR_RENDEZVOUS_SECONDS = 0.5
    job, attempt, a, b = two_rank_attempt
    run_ranks(attempt, [1])
    (again,) = scheduler.schedule_pass()  # requeued: placed again on the same two nodes
    settings.HANGAR_MASTER_PORT_BASE = free_port() - again.pk % 1000

    run_ranks(again, [1])

    a.refresh_from_db()
    b.refresh_from_db()
    assert a.state == NodeState.CORDONED and a.auto_cordoned and "rendezvous failed for 2 attempts" in a.state_reason
    assert b.state == NodeState.READY
    assert scheduler.schedule_pass() == []
    job.refresh_from_db()
    assert job.state == JobState.QUEUED
    waiting = queue_reason(job)
    assert waiting["code"] == "no_ready_node" and "node-a cordoned" in waiting["message"], waiting


def queue_reason(job) -> dict:
    _, by_job = scheduler.queue_report()
    return by_job[job.pk]["reason"]


def test_a_rank_that_reaches_nobody_while_another_reached_rank_zero_is_itself_the_suspect():
    unreachable = rendezvous.Failure(rendezvous.UNREACHABLE, "10.0.0.1:29500 unreachable")
    assert rendezvous.suspect_is_rank_zero(unreachable, others_reached_rank_zero=False)
    assert not rendezvous.suspect_is_rank_zero(unreachable, others_reached_rank_zero=True)
    unresolved = rendezvous.Failure(rendezvous.RANK_ZERO_UNRESOLVED, "gpu-a does not resolve")
    assert rendezvous.suspect_is_rank_zero(unresolved, others_reached_rank_zero=True)
    own = rendezvous.Failure(rendezvous.OWN_HOST, "this host's name does not resolve")
    assert not rendezvous.suspect_is_rank_zero(own, others_reached_rank_zero=False)


def test_rank_zeros_name_that_does_not_resolve_is_told_as_such():
    failure = preflight.unresolved("gpu-a.invalid", 29500)
    assert failure.kind == rendezvous.RANK_ZERO_UNRESOLVED and "gpu-a.invalid does not resolve here" in failure.evidence
    assert preflight.unresolved("127.0.0.1", 29500) is None


def test_the_own_host_check_sees_what_gloo_and_nccl_would(monkeypatch):
    assert preflight.own_host_problem("", "127.0.0.1") is None  # every rank on this host
    missing = preflight.own_host_problem("nosuch0", "10.0.0.1")
    assert missing.kind == rendezvous.OWN_HOST and "nosuch0" in missing.evidence
    assert preflight.own_host_problem("lo", "10.0.0.1") is None  # an interface with an address
    monkeypatch.setattr(preflight.socket, "gethostname", lambda: "gpu-b.invalid")  # no /etc/hosts entry, no DNS
    unnamed = preflight.own_host_problem("", "10.0.0.1")
    assert unnamed.kind == rendezvous.OWN_HOST
    assert "gpu-b.invalid does not resolve" in unnamed.evidence and "fall back to loopback" in unnamed.evidence


def test_rank_zero_stops_waiting_when_the_attempt_ends(db, node):
    port = free_port()
    passed, evidence = preflight.listen_for_ranks(7, port, 1, lambda: False)
    assert not passed and "ended" in evidence


def test_a_rank_that_reaches_a_port_the_job_already_holds_passes():
    with socket.create_server(("127.0.0.1", 0)) as job_store:  # speaks only when spoken to, like a TCPStore
        port = job_store.getsockname()[1]
        passed, evidence = preflight.reach_rank_zero(7, 1, "127.0.0.1", port, lambda: True)
    assert passed and "already listens" in evidence
