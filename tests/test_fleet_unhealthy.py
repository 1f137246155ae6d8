"""The `unhealthy` state: set while an agent reports but cannot use all its GPUs, cleared when it can."""

import pytest

from agent import running
from agent.node import Agent
from fleet.gpus import SimulatedProvider
from fleet.models import FaultInjection, Node, NodeState
from jobs.scheduler import schedule_pass
from portal.models import AuditEvent
from tests.factories import make_job


class HangingDriver(SimulatedProvider):
    """Simulated GPUs whose driver can stop answering (what NVML does when it hangs)."""

    hung = False

    def sample(self, busy, events=True):
        if self.hung:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return super().sample(busy, events)


@pytest.fixture
def sim_agent(db):
    agent = Agent("sim-1", HangingDriver("sim-1", "H100", 2), 5.0)
    agent.register()
    yield agent
    running.CURRENT = None


def state(agent) -> str:
    return Node.objects.get(pk=agent.node.pk).state


def audit(action: str) -> list:
    return list(AuditEvent.objects.filter(action=action).values_list("reason", "detail"))


def test_a_driver_that_stops_answering_makes_the_node_unhealthy_until_it_answers(sim_agent, project, owner):
    sim_agent.provider.hung = True
    sim_agent.report()

    assert state(sim_agent) == NodeState.UNHEALTHY
    ((reason, detail),) = audit("node.unhealthy")
    assert "driver did not answer" in reason and "GPU_IS_LOST" in reason
    assert detail["previous_state"] == "ready" and "GPU_IS_LOST" in detail["evidence"]["error"]
    assert Node.objects.get(pk=sim_agent.node.pk).last_heartbeat_at is not None  # alive: not offline
    make_job(project, owner)
    assert schedule_pass() == []  # nothing goes to an unhealthy node

    sim_agent.provider.hung = False
    sim_agent.report()

    assert state(sim_agent) == NodeState.READY
    assert audit("node.healthy")[0][1]["previous_state"] == "unhealthy"
    assert len(schedule_pass()) == 1


def test_a_gpu_off_the_bus_that_the_policy_does_not_cordon_for_makes_the_node_unhealthy(sim_agent, settings):
    settings.HANGAR_HEALTH_CORDON_KINDS = ["ecc", "nccl"]
    FaultInjection.objects.create(node=sim_agent.node, kind="gpu_lost", gpu_index=1)
    sim_agent.report()

    assert state(sim_agent) == NodeState.UNHEALTHY
    ((reason, detail),) = audit("node.unhealthy")
    assert reason == "GPUs [1] have fallen off the bus" and detail["evidence"]["lost_gpus"] == [1]

    sim_agent.report()
    assert len(audit("node.unhealthy")) == 1  # a condition that lasts is one state change

    FaultInjection.objects.create(node=sim_agent.node, kind="clear")
    sim_agent.report()
    assert state(sim_agent) == NodeState.READY


def test_a_fault_the_policy_cordons_for_stays_a_cordon(sim_agent):
    FaultInjection.objects.create(node=sim_agent.node, kind="gpu_lost", gpu_index=0)
    sim_agent.report()
    FaultInjection.objects.create(node=sim_agent.node, kind="clear")
    sim_agent.report()

    node = Node.objects.get(pk=sim_agent.node.pk)
    assert node.state == NodeState.CORDONED and node.auto_cordoned  # only a burn-in returns it
    assert not audit("node.unhealthy")


def test_an_operators_cordon_of_an_unhealthy_node_is_not_undone_when_it_recovers(sim_agent, owner):
    sim_agent.provider.hung = True
    sim_agent.report()
    Node.objects.get(pk=sim_agent.node.pk).cordon(owner, "investigating the driver")

    sim_agent.provider.hung = False
    sim_agent.report()
    sim_agent.report()

    node = Node.objects.get(pk=sim_agent.node.pk)
    assert node.state == NodeState.CORDONED and node.state_reason == "investigating the driver"


def test_fewer_answering_gpus_than_registered_is_unhealthy():
    from fleet import health
    from fleet.gpus import GpuSample

    samples = [GpuSample(0, 1.0, 1.0, 30.0, 70.0)]
    reason, evidence = health.unhealthy_reason(2, samples)
    assert reason == "only 1 of 2 registered GPUs answer" and evidence["answering_gpus"] == 1
    assert health.unhealthy_reason(1, samples)[0] == ""


def test_an_nvml_driver_error_makes_the_node_unhealthy_until_nvml_answers(db):
    from fleet.gpus import NvmlProvider
    from tests.fakenvml import FakeNvml, NVMLError, device

    class FailingNvml(FakeNvml):
        failing = False

        def nvmlDeviceGetUtilizationRates(self, handle):
            if self.failing:
                raise NVMLError("Unknown Error")
            return super().nvmlDeviceGetUtilizationRates(handle)

    nvml = FailingNvml([device(), device(uuid="GPU-bbbb")])
    nv_agent = Agent("nv-1", NvmlProvider(nvml), 5.0)
    nv_agent.register()
    try:
        nvml.failing = True
        nv_agent.report()
        assert state(nv_agent) == NodeState.UNHEALTHY
        assert "Unknown Error" in Node.objects.get(pk=nv_agent.node.pk).state_reason

        nvml.failing = False
        nv_agent.report()
        assert state(nv_agent) == NodeState.READY
    finally:
        running.CURRENT = None


def test_an_offline_node_whose_agent_returns_with_a_dead_driver_is_unhealthy_not_ready(sim_agent):
    Node.objects.filter(pk=sim_agent.node.pk).update(state=NodeState.OFFLINE)
    sim_agent.provider.hung = True

    sim_agent.report()

    node = Node.objects.get(pk=sim_agent.node.pk)
    assert node.state == NodeState.UNHEALTHY and node.last_heartbeat_at is not None
    assert not AuditEvent.objects.filter(action="node.online").exists()


def test_an_nvml_gpu_that_vanished_from_the_driver_at_agent_restart_keeps_the_node_unhealthy(db):
    from fleet.gpus import NvmlProvider
    from fleet.models import GPU
    from tests.fakenvml import FakeNvml, device

    Agent("nv-1", NvmlProvider(FakeNvml([device(), device(uuid="GPU-bbbb")])), 5.0).register()

    restarted = Agent("nv-1", NvmlProvider(FakeNvml([device()])), 5.0)  # GPU 1 gone from the PCI bus
    restarted.register()
    restarted.report()

    node = Node.objects.get(name="nv-1")
    assert (node.state, node.gpu_count) == (NodeState.UNHEALTHY, 2)
    assert node.state_reason == "the driver lists 1 of 2 registered GPUs (missing [1])"
    assert GPU.objects.get(node=node, index=1).lost

    replaced = Agent("nv-1", NvmlProvider(FakeNvml([device()])), 5.0)
    replaced.register(accept_inventory=True)  # the operator removed the GPU on purpose
    replaced.report()

    node.refresh_from_db()
    assert (node.state, node.gpu_count) == (NodeState.READY, 1)
    running.CURRENT = None
