"""The agent's telemetry, history, fault injection and in-job monitoring; nodes going offline."""

import queue
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.utils import timezone

from agent import runner as execution
from agent import running, watch
from agent.node import Agent
from agent.watch import observe_output
from fleet.gpus import SimulatedProvider
from fleet.models import GPU, FaultInjection, HealthEvent, Node, NodeState, TelemetrySample
from jobs.models import AttemptState, FailureClass, Job, JobState, Stream
from tests.factories import make_attempt, make_job, make_node


@pytest.fixture
def sim_agent(db):
    watch._seen_in_output.clear()
    agent = Agent("sim-1", SimulatedProvider("sim-1", "H100", 4), 5.0)
    agent.register()
    yield agent
    running.CURRENT = None


class FakeRunner:
    """Stands in for agent.runner.Runner: what the agent touches of it."""

    def __init__(self, attempt):
        self.attempt = attempt
        self.lines: queue.Queue = queue.Queue()
        self.proc = SimpleNamespace(pid=4242)
        self.stopped = None

    def request_stop(self, state, failure_class, reason):
        self.stopped = (state, failure_class, reason)


@pytest.fixture
def running_on(sim_agent, project, owner):
    runners = []

    def start(gpus):
        attempt = make_attempt(make_job(project, owner), sim_agent.node, AttemptState.RUNNING, gpu_indices=gpus)
        runner = FakeRunner(attempt)
        execution.RUNNING[attempt.pk] = runner
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        execution.RUNNING.pop(runner.attempt.pk, None)


def test_a_report_stores_latest_telemetry_and_history(sim_agent):
    sim_agent.report()
    sim_agent.report()

    gpus = list(GPU.objects.filter(node=sim_agent.node))
    assert all(g.sampled_at and g.sm_clock_mhz and g.temperature_c for g in gpus)
    assert TelemetrySample.objects.filter(node=sim_agent.node).count() == 8
    assert HealthEvent.objects.count() == 0


def inject(agent, kind, **fields):
    FaultInjection.objects.create(node=agent.node, kind=kind, **fields)
    agent.report()
    agent.node.refresh_from_db()


def test_an_injected_ecc_fault_cordons_and_stops_the_job_on_that_gpu(sim_agent, running_on):
    hit, spared = running_on([1]), running_on([2])

    inject(sim_agent, "ecc", gpu_index=1)

    event = HealthEvent.objects.get()
    assert (event.kind, event.gpu_index, event.action) == ("ecc", 1, "cordoned, job stopped")
    assert sim_agent.node.state == NodeState.CORDONED and sim_agent.node.auto_cordoned
    assert hit.stopped[:2] == (AttemptState.FAILED, FailureClass.INFRA)
    assert spared.stopped is None
    assert GPU.objects.get(node=sim_agent.node, index=1).ecc_uncorrected_volatile == 1
    assert FaultInjection.objects.get().applied_at is not None


@pytest.mark.parametrize(("xid", "cordoned"), [(79, True), (48, True), (94, False), (13, False)])
def test_an_injected_xid_follows_the_xid_table(sim_agent, running_on, xid, cordoned):
    runner = running_on([0])

    inject(sim_agent, "xid", gpu_index=0, xid=xid)

    event = HealthEvent.objects.get()
    assert (event.kind, event.xid) == ("xid", xid)
    assert (sim_agent.node.state == NodeState.CORDONED) is cordoned
    assert (runner.stopped is not None) is cordoned
    assert GPU.objects.get(node=sim_agent.node, index=0).last_xid == xid


@pytest.mark.parametrize("kind", ["thermal", "power"])
def test_throttling_is_recorded_without_cordon(sim_agent, running_on, kind):
    runner = running_on([0])

    inject(sim_agent, kind, gpu_index=0, seconds=60)
    sim_agent.report()

    assert list(HealthEvent.objects.values_list("kind", "action")) == [(kind, "recorded")]
    assert sim_agent.node.state == NodeState.READY and runner.stopped is None
    field = f"{kind}_throttle_s"
    throttled = TelemetrySample.objects.filter(node=sim_agent.node, gpu_index=0, **{f"{field}__gt": 0})
    assert throttled.count() == 2


def test_a_gpu_fallen_off_the_bus_cordons(sim_agent, running_on):
    runner = running_on([3])

    inject(sim_agent, "gpu_lost", gpu_index=3)

    assert HealthEvent.objects.get().kind == "gpu_lost"
    assert sim_agent.node.state == NodeState.CORDONED and runner.stopped is not None
    assert GPU.objects.get(node=sim_agent.node, index=3).lost


def test_an_injected_nccl_failure_reaches_the_jobs_output(sim_agent, running_on):
    runner = running_on([0, 1])

    inject(sim_agent, "nccl")

    stream, _, raw, _ = runner.lines.get_nowait()
    assert stream == Stream.STDERR and b"NCCL WARN" in raw and b"unhandled system error" in raw
    # The injection is the simulated node's own report, not only a line in the job's output: it cordons.
    event = HealthEvent.objects.get()
    assert (event.kind, event.source) == ("nccl", "telemetry") and "cordoned" in event.action
    assert sim_agent.node.state == NodeState.CORDONED and runner.stopped is not None


def test_a_fault_in_the_jobs_output_is_recorded_against_its_attempt(sim_agent, running_on):
    runner = running_on([0])

    for _ in range(3):
        observe_output(runner.attempt, "host:1:2 [0] NCCL WARN Call to ibv_post_send failed: unhandled system error")
    observe_output(runner.attempt, "epoch 1 loss 0.3")

    event = HealthEvent.objects.get()
    assert (event.kind, event.attempt_id, event.source) == ("nccl", runner.attempt.pk, "output")
    assert runner.stopped[:2] == (AttemptState.FAILED, FailureClass.INFRA)
    sim_agent.node.refresh_from_db()
    # Seen only in the job's output, the re-check passed: a suspicion, the node stays ready.
    assert sim_agent.node.state == NodeState.READY
    assert event.action == "suspected, job stopped" and "re-check passed" in event.evidence["decision"]


def test_an_injected_silence_stops_heartbeats_until_cleared(sim_agent):
    before = Node.objects.get(pk=sim_agent.node.pk).last_heartbeat_at

    inject(sim_agent, "agent_silent", seconds=60)
    assert Node.objects.get(pk=sim_agent.node.pk).last_heartbeat_at == before

    inject(sim_agent, "clear")
    assert Node.objects.get(pk=sim_agent.node.pk).last_heartbeat_at > before


def test_clear_removes_simulated_faults(sim_agent):
    inject(sim_agent, "ecc", gpu_index=0)
    inject(sim_agent, "clear")

    assert GPU.objects.get(node=sim_agent.node, index=0).ecc_uncorrected_volatile == 0


def test_a_silent_node_goes_offline_and_its_attempts_are_lost_and_requeued(project, owner, node, settings):
    settings.HANGAR_NODE_OFFLINE_SECONDS = 30
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=31))
    attempt = make_attempt(make_job(project, owner), node, AttemptState.RUNNING)

    assert Node.mark_silent_offline() == [node]

    attempt.refresh_from_db()
    assert (attempt.state, attempt.failure_class) == (AttemptState.LOST, FailureClass.INFRA)
    assert "went offline" in attempt.reason
    job = Job.objects.get(pk=attempt.job_id)
    assert (job.state, job.requeues) == (JobState.QUEUED, 1)
    assert HealthEvent.objects.get().kind == "heartbeat"


def test_old_telemetry_is_folded_into_minute_averages(node):
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(days=2)
    rows = [
        TelemetrySample(
            node=node,
            gpu_index=0,
            at=start + timedelta(seconds=5 * i),
            utilization_pct=float(i % 12),
            temperature_c=50.0,
            power_throttle_s=5.0 if i < 3 else 0.0,
        )
        for i in range(24)  # two minutes of 5 s samples
    ]
    recent = TelemetrySample.objects.create(node=node, gpu_index=0, at=timezone.now(), utilization_pct=99)
    TelemetrySample.objects.bulk_create(rows)

    removed = TelemetrySample.downsample(node, timezone.now() - timedelta(days=1))

    assert removed == 24
    folded = list(TelemetrySample.objects.filter(period_s=60).order_by("at"))
    assert [f.at for f in folded] == [start, start + timedelta(minutes=1)]
    assert [f.utilization_pct for f in folded] == [5.5, 5.5]
    assert [f.power_throttle_s for f in folded] == [15.0, 0.0]
    assert TelemetrySample.objects.filter(period_s=0).get() == recent


def test_a_minute_split_by_the_cutoff_is_folded_once(node):
    minute = timezone.now().replace(second=0, microsecond=0) - timedelta(days=2)
    TelemetrySample.objects.bulk_create(
        TelemetrySample(node=node, gpu_index=0, at=minute + timedelta(seconds=5 * i), utilization_pct=10.0)
        for i in range(12)
    )

    TelemetrySample.downsample(node, minute + timedelta(seconds=30))  # cutoff mid-minute: nothing whole yet
    TelemetrySample.downsample(node, minute + timedelta(minutes=1, seconds=30))

    assert TelemetrySample.objects.filter(period_s=60).count() == 1
    assert not TelemetrySample.objects.filter(period_s=0).exists()


def test_a_silent_node_holding_another_rank_of_a_gang_loses_the_gang(project, owner, node, settings):
    """A 2-node attempt whose rank 1 ran on a host that went silent (a partition): rank 0 alone would
    wait in its collectives until the max runtime; the attempt is lost and the job requeued."""
    settings.HANGAR_NODE_OFFLINE_SECONDS = 30
    other = make_node("node-b")
    Node.objects.filter(pk=other.pk).update(last_heartbeat_at=timezone.now() - timedelta(seconds=31))
    job = make_job(project, owner, nodes=2, gpus_per_node=1)
    placement = [{"rank": 0, "node_id": node.pk, "node": node.name, "gpus": [0]}]
    placement.append({"rank": 1, "node_id": other.pk, "node": other.name, "gpus": [0]})
    attempt = make_attempt(job, node, AttemptState.RUNNING, placement=placement)

    assert Node.mark_silent_offline() == [other]

    attempt.refresh_from_db()
    assert (attempt.state, attempt.failure_class) == (AttemptState.LOST, FailureClass.INFRA)
    assert "node node-b went offline" in attempt.reason
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
