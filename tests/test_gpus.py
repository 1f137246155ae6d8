"""GPU providers (the simulator and NVML behind a fake pynvml) and the agent's registration."""

import pytest

from agent.node import Agent
from fleet.gpus import GpuInfo, NvmlProvider, SimulatedProvider, detect_provider, short_model_name
from fleet.models import GPU, Node
from jobs.models import AttemptState, FailureClass, Job, JobState
from tests.factories import make_attempt, make_job
from tests.fakenvml import FakeNvml, device

# --- The simulator ---------------------------------------------------------------


def test_the_simulator_lists_its_gpus():
    inventory = SimulatedProvider("sim-1", "H200", 8).inventory()

    assert [g.index for g in inventory] == list(range(8))
    assert {g.model for g in inventory} == {"H200"}
    assert {g.memory_total_mb for g in inventory} == {143771}
    assert len({g.uuid for g in inventory}) == 8
    assert all(g.uuid.startswith("GPU-SIM-") for g in inventory)


def test_the_simulators_uuids_are_stable_per_node():
    again = SimulatedProvider("sim-1", "H100", 4).inventory()
    other = SimulatedProvider("sim-2", "H100", 4).inventory()

    assert [g.uuid for g in SimulatedProvider("sim-1", "H100", 4).inventory()] == [g.uuid for g in again]
    assert not {g.uuid for g in again} & {g.uuid for g in other}


def test_the_simulator_runs_busy_gpus_hot_and_idle_ones_cool():
    provider = SimulatedProvider("sim-1", "H100", 4)

    for _ in range(20):
        samples = {s.index: s for s in provider.sample(busy={1, 3})}
        assert sorted(samples) == [0, 1, 2, 3]
        for busy in (1, 3):
            assert 85 <= samples[busy].utilization_pct <= 100
            assert samples[busy].power_w > 600
        for idle in (0, 2):
            assert samples[idle].utilization_pct <= 2
            assert samples[idle].power_w < 100
        assert samples[1].memory_used_mb > samples[0].memory_used_mb
        assert samples[1].temperature_c > samples[0].temperature_c


def test_the_simulator_refuses_an_unknown_model():
    with pytest.raises(ValueError, match="unknown simulated GPU model 'V100'; use one of A100, B300"):
        SimulatedProvider("sim-1", "V100")


def test_forcing_simulation_gives_the_simulator():
    provider = detect_provider("sim-1", simulate=True, model="B300", count=2)

    assert isinstance(provider, SimulatedProvider)
    assert provider.simulated
    assert [g.model for g in provider.inventory()] == ["B300", "B300"]


@pytest.mark.parametrize(
    ("name", "short"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA B300", "B300"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("NVIDIA GH200 480GB", "GH200"),
    ],
)
def test_it_shortens_nvml_names_to_the_gpu_type(name, short):
    assert short_model_name(name) == short


def test_a_name_without_a_model_number_is_kept():
    assert short_model_name(" Mystery GPU ") == "Mystery GPU"


# --- NVML, through a fake pynvml ------------------------------------------------------


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            device(name=b"NVIDIA H100 80GB HBM3", uuid=b"GPU-aaaa", used_mb=1024, util=87, temp=71, power_mw=612345),
            device(
                name="NVIDIA A100-SXM4-80GB",
                uuid="GPU-bbbb",
                total_mb=81920,
                used_mb=512.5,
                util=3,
                temp=34,
                power_mw=58000,
            ),
        ]
    )


def test_nvml_inventory_decodes_names_and_converts_memory():
    provider = NvmlProvider(two_gpus())

    assert not provider.simulated
    assert provider.inventory() == [
        GpuInfo(0, "GPU-aaaa", "H100", 81559),
        GpuInfo(1, "GPU-bbbb", "A100", 81920),
    ]
    assert all(isinstance(g.memory_total_mb, int) for g in provider.inventory())


def test_nvml_samples_convert_units():
    first, second = NvmlProvider(two_gpus()).sample(busy=set())

    assert (first.index, first.utilization_pct, first.memory_used_mb) == (0, 87.0, 1024.0)
    assert (first.temperature_c, first.power_w) == (71.0, pytest.approx(612.345))
    assert (second.index, second.utilization_pct, second.memory_used_mb) == (1, 3.0, 512.5)
    assert (second.temperature_c, second.power_w) == (34.0, 58.0)


# --- The agent's registration -------------------------------------------------------


def test_registering_creates_the_node_and_its_gpus(db):
    provider = SimulatedProvider("sim-1", "A100", 2)

    node = Agent("sim-1", provider, 1.0).register()

    node = Node.objects.get(pk=node.pk)
    assert node.name == "sim-1"
    assert node.gpu_model == "A100"
    assert node.gpu_count == 2
    assert node.simulated is True
    assert node.last_heartbeat_at is not None
    gpus = list(GPU.objects.filter(node=node).values_list("index", "uuid", "model", "memory_total_mb"))
    assert gpus == [(g.index, g.uuid, g.model, g.memory_total_mb) for g in provider.inventory()]


def test_registering_again_changes_nothing(db):
    provider = SimulatedProvider("sim-1", "H100", 4)
    first = Agent("sim-1", provider, 1.0).register()
    gpu_ids = list(GPU.objects.values_list("pk", flat=True))

    second = Agent("sim-1", provider, 1.0).register()

    assert second.pk == first.pk
    assert Node.objects.count() == 1
    assert list(GPU.objects.values_list("pk", flat=True)) == gpu_ids


def test_registering_with_fewer_gpus_drops_the_missing_ones(db):
    Agent("sim-1", SimulatedProvider("sim-1", "H100", 4), 1.0).register()

    node = Agent("sim-1", SimulatedProvider("sim-1", "H100", 2), 1.0).register()

    assert node.gpu_count == 2
    assert list(node.gpus.values_list("index", flat=True)) == [0, 1]


def test_registering_ends_attempts_the_previous_agent_was_running(project, owner):
    agent = Agent("sim-1", SimulatedProvider("sim-1", "H100", 4), 1.0)
    node = agent.register()
    running = make_job(project, owner)
    running_attempt = make_attempt(running, node, AttemptState.RUNNING, gpu_indices=[0])
    waiting = make_job(project, owner)
    waiting_attempt = make_attempt(waiting, node, AttemptState.SCHEDULED, gpu_indices=[1])

    agent.register()

    running_attempt.refresh_from_db()
    assert running_attempt.state == AttemptState.LOST
    assert running_attempt.failure_class == FailureClass.INFRA
    assert "agent restarted" in running_attempt.reason
    assert Job.objects.get(pk=running.pk).state == JobState.QUEUED
    # Not started yet: the new agent takes it from its queue.
    waiting_attempt.refresh_from_db()
    assert waiting_attempt.state == AttemptState.SCHEDULED
