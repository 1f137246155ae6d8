"""Health findings and policy: output patterns, telemetry changes, the Xid table, auto-cordon."""

import pytest

from fleet import health
from fleet.gpus import GpuSample
from fleet.health import (
    Action,
    Corroboration,
    Finding,
    Kind,
    Policy,
    XidRule,
    decide,
    scan_line,
    storm_repeat,
    telemetry_findings,
)
from fleet.models import HealthEvent, NodeState, XidPolicy
from portal.models import AuditEvent


@pytest.mark.parametrize(
    ("line", "kind", "xid"),
    [
        ("gpu-3:1234:1250 [0] NCCL INFO transport/net_ib.cc:93 -> 2 unhandled system error", Kind.NCCL, None),
        ("host:55:60 [1] NCCL WARN Call to ibv_post_send failed", Kind.NCCL, None),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", Kind.ECC, None),
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.", Kind.XID, 79),
        ("[12.5] NVRM: Xid (PCI:0000:18:00): 48, pid=7, An uncorrectable double bit error", Kind.XID, 48),
    ],
)
def test_it_finds_faults_in_job_output(line, kind, xid):
    finding = scan_line(line)

    assert finding is not None
    assert (finding.kind, finding.xid) == (kind, xid)
    assert finding.evidence["line"] == line


@pytest.mark.parametrize(
    "line",
    ["epoch 3 loss 0.12", "NCCL INFO Bootstrap : Using eth0", "ECC is enabled", "bus factor 3", "Xid-like text"],
)
def test_ordinary_lines_are_not_findings(line):
    assert scan_line(line) is None


def sample(index=0, **fields) -> GpuSample:
    return GpuSample(index, 50.0, 1000.0, 50.0, 300.0, **fields)


def test_throttling_is_reported_when_it_begins_not_while_it_lasts():
    hot = sample(throttle_reasons=("hw_thermal",))

    began = telemetry_findings({0: sample()}, [hot])
    lasting = telemetry_findings({0: hot}, [hot])

    assert [(f.kind, f.severity) for f in began] == [(Kind.THERMAL, "warning")]
    assert lasting == []
    assert [f.kind for f in telemetry_findings({}, [sample(throttle_reasons=("sw_power_cap",))])] == [Kind.POWER]


def test_growing_ecc_counts_xids_and_a_lost_gpu_are_findings():
    previous = {0: sample(ecc_uncorrected_volatile=1), 1: sample(1)}

    found = telemetry_findings(previous, [sample(ecc_uncorrected_volatile=2), sample(1, xids=(79,), lost=True)])

    assert sorted((f.kind, f.gpu_index, f.xid) for f in found) == [
        (Kind.ECC, 0, None),
        (Kind.GPU_LOST, 1, None),
        (Kind.XID, 1, 79),
    ]
    assert telemetry_findings({0: sample(ecc_uncorrected_volatile=2)}, [sample(ecc_uncorrected_volatile=2)]) == []


def test_the_default_policy_cordons_hardware_faults_only():
    policy = Policy()

    def cordons(kind):
        return decide(Finding(kind, "critical", "x"), policy).cordon

    assert cordons(Kind.ECC) and cordons(Kind.GPU_LOST) and cordons(Kind.NCCL)
    assert not cordons(Kind.THERMAL) and not cordons(Kind.POWER)
    assert decide(Finding(Kind.ECC, "critical", "x"), policy).stop_job
    assert not decide(Finding(Kind.THERMAL, "warning", "x"), policy).stop_job


def test_xid_rules_cordon_trend_or_ignore():
    def xid(n):
        return Finding(Kind.XID, "critical", "x", xid=n)

    policy = Policy()
    assert decide(xid(79), policy, XidRule(Action.CORDON)).cordon
    assert decide(xid(79), policy, XidRule(Action.CORDON)).stop_job
    assert not decide(xid(13), policy, XidRule(Action.IGNORE)).cordon
    assert not decide(xid(94), policy, XidRule(Action.TREND, threshold=3), recent_same_xid=1).cordon
    assert decide(xid(94), policy, XidRule(Action.TREND, threshold=3), recent_same_xid=2).cordon


def test_the_default_xid_table_is_seeded_for_operators_to_edit(db):
    table = dict(XidPolicy.objects.values_list("xid", "action"))

    assert all(table[x] == Action.CORDON for x in (46, 48, 64, 74, 79, 95))
    assert all(table[x] == Action.TREND for x in (63, 92, 94))
    assert all(table[x] == Action.IGNORE for x in (13, 31, 43, 45))
    assert XidPolicy.rule_for(79).action == Action.CORDON


@pytest.mark.django_db(transaction=True)
def test_the_default_xid_table_comes_back_after_the_database_is_emptied_and_keeps_edits():
    """A flush (every transactional test ends with one) emptied the table the migration seeded:
    later tests of the same worker found no Xid 46 (run after tests/test_api_jobs.py)."""
    from django.core.management import call_command

    XidPolicy.objects.filter(xid=79).update(action=Action.IGNORE)  # an operator's edit
    XidPolicy.ensure_defaults()
    assert XidPolicy.objects.get(xid=79).action == Action.IGNORE
    call_command("flush", interactive=False, verbosity=0)
    assert XidPolicy.objects.get(xid=46).action == Action.CORDON
    assert XidPolicy.objects.get(xid=79).action == Action.CORDON


def test_a_cordoning_event_cordons_the_node_with_evidence(node):
    finding = Finding(Kind.XID, "critical", "GPU 2: Xid 79", gpu_index=2, xid=79, evidence={"xid": 79})

    event, decision = HealthEvent.record(node, finding)

    node.refresh_from_db()
    assert decision.cordon and decision.stop_job
    assert (node.state, node.auto_cordoned) == (NodeState.CORDONED, True)
    assert "Xid 79" in node.state_reason
    assert event.action == "cordoned, job stopped"
    audit = AuditEvent.objects.get(action="node.auto_cordon")
    assert audit.actor is None
    assert audit.detail["previous_state"] == "ready"
    assert audit.detail["evidence"]["health_event"] == event.pk


def test_a_trend_xid_cordons_once_it_repeats_past_its_threshold(node, settings):
    settings.HANGAR_XID_STORM_SECONDS = 0  # each repeat counts (the storm limiter is tested below)
    XidPolicy.objects.filter(xid=94).update(threshold=2)
    finding = Finding(Kind.XID, "critical", "Xid 94", gpu_index=0, xid=94)

    first, _ = HealthEvent.record(node, finding)
    node.refresh_from_db()
    assert first.action == "recorded" and node.state == NodeState.READY

    second, _ = HealthEvent.record(node, finding)
    node.refresh_from_db()
    assert second.action.startswith("cordoned") and node.state == NodeState.CORDONED


def test_an_xid_storm_from_one_gpu_counts_once_per_window(node):
    XidPolicy.objects.filter(xid=94).update(threshold=2)
    finding = Finding(Kind.XID, "critical", "Xid 94", gpu_index=0, xid=94)

    events = {HealthEvent.record(node, finding)[0].pk for _ in range(50)}

    node.refresh_from_db()
    assert len(events) == 1 and HealthEvent.objects.count() == 1
    assert HealthEvent.objects.get().evidence["repeats"] == 49
    assert node.state == NodeState.READY  # a storm is one Xid, not a trend past its threshold
    HealthEvent.record(node, Finding(Kind.XID, "critical", "Xid 94", gpu_index=1, xid=94))
    node.refresh_from_db()
    assert node.state == NodeState.CORDONED  # another GPU's Xid is another report


def test_an_operator_can_change_what_an_xid_means(node):
    XidPolicy.objects.filter(xid=79).update(action=Action.IGNORE)

    event, decision = HealthEvent.record(node, Finding(Kind.XID, "critical", "Xid 79", xid=79))

    node.refresh_from_db()
    assert not decision.cordon and node.state == NodeState.READY and event.action == "recorded"


def test_the_policy_is_configurable(node, settings):
    settings.HANGAR_HEALTH_CORDON_KINDS = ["thermal"]

    HealthEvent.record(node, Finding(Kind.ECC, "critical", "ecc"))
    node.refresh_from_db()
    assert node.state == NodeState.READY

    HealthEvent.record(node, Finding(Kind.THERMAL, "warning", "hot"))
    node.refresh_from_db()
    assert node.state == NodeState.CORDONED
    assert health.Kind.THERMAL in node.state_reason


def test_the_straggler_is_the_node_that_throttled_most():
    from fleet.charts import straggler

    assert straggler({"gpu-1": 12.0, "gpu-2": 340.0, "gpu-3": 0.0}) == "gpu-2"
    assert straggler({"gpu-1": 0.0, "gpu-2": 0.0}) is None
    assert straggler({}) is None


@pytest.mark.parametrize("state", ["cordoned", "draining", "offline", "unhealthy"])
def test_work_is_never_placed_on_a_node_that_is_out(project, owner, state):
    from jobs.scheduler import schedule_pass
    from tests.factories import make_job, make_node

    make_node("out", state=state)
    make_job(project, owner)

    assert schedule_pass() == []


def test_draining_lets_running_work_finish(project, owner, node):
    from jobs.models import AttemptState
    from tests.factories import make_attempt, make_job

    attempt = make_attempt(make_job(project, owner), node, AttemptState.RUNNING)

    assert node.drain(owner, "reboot after the current jobs")

    attempt.refresh_from_db()
    node.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING and node.state == NodeState.DRAINING


OUTPUT_XID = Finding(Kind.XID, "critical", "Xid 79 in the job's output", xid=79, source="output")
CORDON_79 = XidRule(Action.CORDON)


@pytest.mark.parametrize(
    ("corroboration", "cordon", "stop", "why"),
    [
        (Corroboration(), False, True, "not cordoned: seen only in the job's output"),
        (Corroboration(rechecked=True), False, True, "re-check passed"),
        (Corroboration(recheck_failures=("ecc: GPU 0: 1 uncorrectable",)), True, True, "re-check failed: ecc"),
        (Corroboration(driver_reports=("GPU 0: Xid 79",)), True, True, "the driver reports: GPU 0: Xid 79"),
        (Corroboration(reporters=2, needed_reporters=2), True, True, "jobs of 2 different users"),
        (Corroboration(reporters=1, needed_reporters=2), False, True, "1 of 2 users"),
        (Corroboration(reported_first_on="node node-b"), False, False, "node node-b reported it first"),
        (Corroboration(follows_job="job 4 reported it on node node-c too"), False, False, "follows the job"),
    ],
)
def test_a_fault_from_a_jobs_output_cordons_only_when_corroborated(corroboration, cordon, stop, why):
    decision = decide(OUTPUT_XID, Policy(), CORDON_79, 0, corroboration)

    assert (decision.cordon, decision.stop_job, decision.suspected) == (cordon, stop, not cordon)
    assert why in decision.why


def test_the_same_fault_from_the_driver_needs_no_corroboration():
    finding = Finding(Kind.XID, "critical", "GPU 0: Xid 79", gpu_index=0, xid=79)
    assert decide(finding, Policy(), CORDON_79).cordon
    assert not decide(OUTPUT_XID, Policy(), XidRule(Action.IGNORE), 0, Corroboration()).suspected  # nothing to weigh


def test_the_storm_limiter_counts_a_repeat_once_per_window():
    assert storm_repeat(100.0, 130.0, 60) and not storm_repeat(100.0, 170.0, 60) and not storm_repeat(None, 1.0, 60)
