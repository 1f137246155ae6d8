"""Multi-node preflight: every rank reaches rank 0 on the rendezvous port before the command starts."""

import socket
import sys
import threading

import pytest
from django.utils import timezone

from agent import preflight, running
from agent import runner as execution
from fleet.models import GPU, HealthCheck, NodeState
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


def test_a_rank_that_cannot_reach_rank_zero_cordons_its_node_and_requeues_the_job(two_rank_attempt, settings):
    settings.HANGAR_RENDEZVOUS_SECONDS = 1.0
    job, attempt, a, b = two_rank_attempt

    run_ranks(attempt, [1])  # rank 0's agent never listens

    job.refresh_from_db()
    attempt.refresh_from_db()
    b.refresh_from_db()
    assert (attempt.state, attempt.failure_class) == (AttemptState.FAILED, FailureClass.INFRA)
    assert "rendezvous" in attempt.reason and "unreachable" in attempt.reason
    assert job.state == JobState.QUEUED and job.retries == 0  # requeued without using a retry
    assert b.state == NodeState.CORDONED and b.auto_cordoned and "rendezvous" in b.state_reason
    check = HealthCheck.objects.get(attempt=attempt, name="rendezvous")
    assert (check.node, check.passed) == (b, False) and "127.0.0.1:" in check.evidence
    assert Attempt.objects.get(pk=attempt.pk).running_at is None  # the command never started


def test_rank_zero_stops_waiting_when_the_attempt_ends(db, node):
    port = free_port()
    passed, evidence = preflight.listen_for_ranks(7, port, 1, lambda: False)
    assert not passed and "ended" in evidence


def test_a_rank_that_reaches_a_port_the_job_already_holds_passes():
    with socket.create_server(("127.0.0.1", 0)) as job_store:  # speaks only when spoken to, like a TCPStore
        port = job_store.getsockname()[1]
        passed, evidence = preflight.reach_rank_zero(7, 1, "127.0.0.1", port, lambda: True)
    assert passed and "already listens" in evidence
