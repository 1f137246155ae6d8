"""Preflight: recorded checks, cordon on failure, the job placed elsewhere; burn-in and its override."""

import sys

import pytest
from django.utils import timezone

from agent import preflight, running
from agent import runner as execution
from agent.node import Agent
from fleet.gpus import SimulatedProvider
from fleet.models import GPU, HealthCheck, Node, NodeState
from fleet.preflight import return_to_service
from jobs import scheduler
from jobs.models import AttemptState, FailureClass, JobState
from portal.models import AuditEvent
from tests.factories import make_attempt, make_job, make_node


@pytest.fixture(autouse=True)
def no_agent_in_this_process():
    running.CURRENT = None
    yield
    running.CURRENT = None


def healthy(node: Node) -> Node:
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    return node


def test_preflight_failure_on_one_of_two_nodes_places_the_job_on_the_other(transactional_db, project, owner):
    bad = healthy(make_node("node-bad", gpus=2))
    good = healthy(make_node("node-good", gpus=4))
    GPU.objects.filter(node=bad, index=0).update(ecc_uncorrected_volatile=1, retired_pages_pending=True)
    job = make_job(project, owner, command=[sys.executable, "-c", "print('hello from the good node')"])

    (first,) = scheduler.schedule_pass()
    assert first.node == bad  # best fit: the smaller node
    execution.run_attempt(first.pk)

    first.refresh_from_db()
    assert (first.state, first.failure_class) == (AttemptState.FAILED, FailureClass.INFRA)
    assert "preflight failed: ecc: GPU 0: 1 uncorrectable ECC errors" in first.reason
    bad.refresh_from_db()
    assert (bad.state, bad.auto_cordoned) == (NodeState.CORDONED, True)
    assert bad.state_reason.startswith("preflight failed: ecc")
    job.refresh_from_db()
    assert (job.state, job.requeues) == (JobState.QUEUED, 1)

    (second,) = scheduler.schedule_pass()
    assert second.node == good
    execution.run_attempt(second.pk)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert [(a.node.name, a.state) for a in job.attempts.all()] == [
        ("node-bad", AttemptState.FAILED),
        ("node-good", AttemptState.SUCCEEDED),
    ]
    checks = {c.name: c for c in HealthCheck.objects.filter(attempt=first)}
    assert set(checks) == {"devices", "device_type", "driver", "ecc", "temperature", "throttle"}
    assert not checks["ecc"].passed and "retired pages pending=True" in checks["ecc"].evidence
    assert all(c.duration_ms >= 0 for c in checks.values())
    assert all(c.passed for c in HealthCheck.objects.filter(attempt=second))


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({"temperature_c": 93.0}, "temperature"),
        ({"throttle_reasons": ["hw_thermal"]}, "throttle"),
        ({"lost": True}, "driver"),
        ({"sampled_at": None}, "driver"),
        ({"remapped_rows_pending": True}, "ecc"),
    ],
)
def test_each_check_fails_on_its_own_fault(project, owner, change, failed):
    node = healthy(make_node())
    GPU.objects.filter(node=node, index=1).update(**change)
    attempt = make_attempt(make_job(project, owner), node, AttemptState.PREFLIGHT, gpu_indices=[1])

    failures = preflight.run_preflight(attempt, "H100")

    assert [f.split(":")[0] for f in failures] == [failed]
    node.refresh_from_db()
    assert node.state == NodeState.CORDONED


def test_missing_devices_and_the_wrong_type_fail(project, owner):
    node = healthy(make_node(gpus=2))
    attempt = make_attempt(make_job(project, owner), node, AttemptState.PREFLIGHT, gpu_indices=[1, 5])

    failures = preflight.run_preflight(attempt, "B300")

    assert [f.split(":")[0] for f in failures] == ["devices", "device_type"]


def test_a_healthy_node_passes_and_stays_ready(project, owner, node):
    healthy(node)
    attempt = make_attempt(make_job(project, owner), node, AttemptState.PREFLIGHT, gpu_indices=[0, 1])

    assert preflight.run_preflight(attempt, "H100") == []
    node.refresh_from_db()
    assert node.state == NodeState.READY
    assert HealthCheck.objects.filter(attempt=attempt, passed=True).count() == 6


def agent_for(node: Node) -> Agent:
    """This test process plays the node's agent, with simulated GPUs: the stress step runs here."""
    sim = Agent(node.name, SimulatedProvider(node.name, node.gpu_model, node.gpu_count), 5.0)
    sim.node = node
    running.CURRENT = sim
    return sim


def test_uncordoning_an_auto_cordoned_node_runs_a_burn_in(node, owner, settings):
    settings.HANGAR_BURN_IN_STRESS_SECONDS = 0.3
    agent_for(healthy(node))
    GPU.objects.filter(node=node, index=3).update(ecc_uncorrected_volatile=2)
    node.auto_cordon("Xid 48", {"xid": 48})

    refused = return_to_service(node, owner, "replaced the DIMM")

    node.refresh_from_db()
    assert not refused.done and "burn-in failed" in refused.message and "GPU 3" in refused.message
    assert node.state == NodeState.CORDONED
    assert AuditEvent.objects.filter(action="node.burn_in_failed", actor=owner).exists()

    GPU.objects.filter(node=node).update(ecc_uncorrected_volatile=0)
    passed = return_to_service(node, owner, "replaced the DIMM")

    node.refresh_from_db()
    assert passed.done and node.state == NodeState.READY and not node.auto_cordoned
    audit = AuditEvent.objects.filter(action="node.uncordon").first()
    assert audit.actor == owner and audit.reason == "replaced the DIMM"
    assert audit.detail["previous_state"] == "cordoned"
    assert audit.detail["evidence"]["burn_in"]["ecc"]["passed"] is True
    stress = audit.detail["evidence"]["burn_in"]["stress"]
    assert stress["passed"] is True and "simulated stress: GPUs [0, 1, 2, 3] loaded" in stress["evidence"]
    # 7 checks refused (the stress step is not run on a node that fails one), then 7 and the stress.
    assert HealthCheck.objects.filter(node=node, suite="burn-in").count() == 15


def test_a_fault_that_shows_only_under_load_fails_the_burn_in(node, owner, settings):
    settings.HANGAR_BURN_IN_STRESS_SECONDS = 0.3
    sim = agent_for(healthy(node))
    node.auto_cordon("Xid 79", {"xid": 79})
    sim.provider.inject("thermal", 2, seconds=60)  # idle telemetry is fine; the stress throttles

    refused = return_to_service(node, owner, "reseated the GPU")

    node.refresh_from_db()
    assert not refused.done and node.state == NodeState.CORDONED and node.auto_cordoned
    assert "stress: simulated stress: GPU 2 throttled under load" in refused.message
    check = HealthCheck.objects.get(node=node, suite="burn-in", name="stress")
    assert not check.passed and check.duration_ms >= 300 and "hw_thermal" in check.evidence
    audit = AuditEvent.objects.get(action="node.burn_in_failed")
    assert audit.actor == owner and audit.detail["burn_in"]["stress"]["passed"] is False

    sim.provider.inject("clear")
    assert return_to_service(node, owner, "reseated the GPU").done


def test_a_burn_in_whose_node_agent_does_not_answer_fails(node, owner, settings):
    settings.HANGAR_BURN_IN_WAIT_SECONDS = 0.5  # no agent consumes this node's queue here
    healthy(node).auto_cordon("Xid 79", {"xid": 79})

    refused = return_to_service(node, owner, "replaced the GPU")

    node.refresh_from_db()
    assert not refused.done and node.state == NodeState.CORDONED
    assert "agent did not run the stress step within 0.5s" in refused.message


def test_on_real_gpus_the_stress_is_a_torch_matmul_or_skipped_with_the_reason(node):
    from agent import stress

    python, tried = stress.torch_python(stress.interpreters(node))
    passed, evidence = stress.with_torch(node, [0], 1.0)

    if python is None:  # this machine: no CUDA device for torch to see
        assert passed and evidence.startswith("skipped: no interpreter with PyTorch and CUDA") and tried in evidence
    else:
        assert passed and "TFLOP/s, consistent" in evidence, evidence


def test_an_operator_can_override_the_burn_in_with_a_reason(node, owner):
    GPU.objects.filter(node=node).update(lost=True, sampled_at=timezone.now())
    node.auto_cordon("GPU fell off the bus")

    result = return_to_service(node, owner, "known flaky sensor, vendor ticket 123", override=True)

    node.refresh_from_db()
    assert result.done and node.state == NodeState.READY
    audit = AuditEvent.objects.get(action="node.uncordon_override")
    assert audit.reason == "known flaky sensor, vendor ticket 123" and audit.actor == owner


def test_a_node_an_operator_cordoned_is_uncordoned_without_burn_in(node, owner):
    node.cordon(owner, "maintenance")

    assert return_to_service(node, owner, "done").done
    node.refresh_from_db()
    assert node.state == NodeState.READY
    assert not HealthCheck.objects.filter(suite="burn-in").exists()


def test_rendezvous_reachability():
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        ok, evidence = preflight.rendezvous_reachable("127.0.0.1", port)
    assert ok and "reachable" in evidence
    ok, evidence = preflight.rendezvous_reachable("127.0.0.1", port, timeout=0.5)
    assert not ok and "unreachable" in evidence
