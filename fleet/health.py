"""Health findings and the policy that acts on them: pure functions over plain data.

A finding is something seen on a node: in its GPUs' telemetry (throttling,
ECC, Xid, a GPU fallen off the bus) or in a job's own output (NCCL and CUDA
errors, Xid lines). The policy says whether it cordons the node and whether
the job on it is stopped and requeued. `fleet.models.HealthEvent.record`
stores the finding and applies the decision.
"""

import re
from dataclasses import dataclass, field

from fleet.gpus import GpuSample


class Kind:
    XID = "xid"
    ECC = "ecc"
    GPU_LOST = "gpu_lost"
    THERMAL = "thermal"
    POWER = "power"
    NCCL = "nccl"
    HEARTBEAT = "heartbeat"
    PREFLIGHT = "preflight"
    RENDEZVOUS = "rendezvous"


class Source:
    """Where a finding was seen: the node's own driver and telemetry, or a job's output (untrusted)."""

    TELEMETRY = "telemetry"
    OUTPUT = "output"
    PREFLIGHT = "preflight"  # Hangar's own checks before a job's command runs (the rendezvous)


class Action:
    CORDON = "cordon"
    TREND = "trend"
    IGNORE = "ignore"


# Xid -> (action, what it usually means). `trend` Xids cordon once they repeat
# past their threshold within the window. Operators edit the table (XidPolicy).
DEFAULT_XID_POLICY: dict[int, tuple[str, str]] = {
    13: (Action.IGNORE, "graphics engine exception: usually the application"),
    31: (Action.IGNORE, "GPU memory page fault: usually the application"),
    43: (Action.IGNORE, "GPU stopped processing: usually the application"),
    45: (Action.IGNORE, "preemptive cleanup after an earlier error"),
    46: (Action.CORDON, "GPU stopped processing"),
    48: (Action.CORDON, "double-bit ECC error"),
    63: (Action.TREND, "ECC page retirement or row remapping recorded"),
    64: (Action.CORDON, "ECC page retirement or row remapping failed"),
    74: (Action.CORDON, "NVLink error"),
    79: (Action.CORDON, "GPU has fallen off the bus"),
    92: (Action.TREND, "high single-bit ECC error rate"),
    94: (Action.TREND, "contained ECC error"),
    95: (Action.CORDON, "uncontained ECC error"),
}
DEFAULT_XID_THRESHOLD = 3
DEFAULT_XID_WINDOW_MINUTES = 60


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: str  # "info", "warning" or "critical"
    message: str
    gpu_index: int | None = None
    xid: int | None = None
    evidence: dict = field(default_factory=dict)
    source: str = Source.TELEMETRY


@dataclass(frozen=True)
class Decision:
    cordon: bool
    stop_job: bool
    why: str
    suspected: bool = False  # seen only in a job's output and not corroborated: the node stays ready
    evidence: tuple[str, ...] = ()  # what corroborated a finding from a job's output


@dataclass(frozen=True)
class Corroboration:
    """What backs (or not) a finding seen in a job's output; `fleet.evidence` loads it.

    A job is untrusted: the text it prints is a suspicion, and cordons its node only
    with evidence from somewhere else: the agent's immediate re-check of the node's
    GPUs, the driver's own reports, or jobs of several users seeing the same there.
    """

    recheck_failures: tuple[str, ...] = ()  # failed checks of the agent's re-check of the node's GPUs
    rechecked: bool = False  # whether a re-check ran at all (only the node's own agent can run one)
    driver_reports: tuple[str, ...] = ()  # driver/telemetry findings on the node within the window
    reporters: int = 1  # distinct users (or projects, whichever is more) whose jobs reported it there
    needed_reporters: int = 2
    window_seconds: float = 600.0
    reported_first_on: str = ""  # another node of the same attempt reported it first: the evidence points there
    follows_job: str = ""  # the same job reported it on another node before: it follows the job, not the node


@dataclass(frozen=True)
class Policy:
    """Which finding kinds cordon the node and which stop (and requeue) the job there."""

    cordon_kinds: frozenset[str] = frozenset({Kind.ECC, Kind.GPU_LOST, Kind.NCCL})
    stop_kinds: frozenset[str] = frozenset({Kind.ECC, Kind.GPU_LOST, Kind.NCCL, Kind.XID})


@dataclass(frozen=True)
class XidRule:
    action: str
    threshold: int = DEFAULT_XID_THRESHOLD
    window_minutes: int = DEFAULT_XID_WINDOW_MINUTES


def decide(
    finding: Finding,
    policy: Policy,
    xid_rule: XidRule | None = None,
    recent_same_xid: int = 0,
    corroboration: Corroboration | None = None,
) -> Decision:
    """What to do about a finding. `recent_same_xid` counts earlier events of the same Xid in the rule's window.
    A finding from a job's output cordons only when `corroboration` backs it (see `weigh_suspicion`)."""
    decision = decide_fault(finding, policy, xid_rule, recent_same_xid)
    if finding.source != Source.OUTPUT or not decision.cordon:
        return decision
    return weigh_suspicion(decision, corroboration or Corroboration())


def weigh_suspicion(fault: Decision, c: Corroboration) -> Decision:
    """A finding from a job's output that would cordon a node: cordon only with evidence beyond the
    output; otherwise the node stays ready and the decision says why. The job may still be stopped
    (and requeued away from the node), unless the finding follows the job from node to node."""
    if c.reported_first_on:
        return Decision(False, False, f"not cordoned: {c.reported_first_on} reported it first", suspected=True)
    if c.follows_job:
        why = f"not cordoned, job not stopped: {c.follows_job}; it follows the job, not the node"
        return Decision(False, False, why, suspected=True)
    evidence = []
    if c.recheck_failures:
        evidence.append("the agent's re-check failed: " + "; ".join(c.recheck_failures))
    if c.driver_reports:
        evidence.append("the driver reports: " + "; ".join(c.driver_reports))
    if c.reporters >= c.needed_reporters:
        evidence.append(f"jobs of {c.reporters} different users reported it here within {c.window_seconds:g}s")
    if evidence:
        return Decision(
            True, fault.stop_job, f"{fault.why}; corroborated: " + "; ".join(evidence), False, tuple(evidence)
        )
    checked = "the agent's re-check passed" if c.rechecked else "no re-check could run"
    why = (
        f"not cordoned: seen only in the job's output ({checked}; the driver reports nothing; "
        f"{c.reporters} of {c.needed_reporters} users' jobs reported it within {c.window_seconds:g}s)"
    )
    return Decision(False, fault.stop_job, why, suspected=True)


def decide_fault(finding: Finding, policy: Policy, xid_rule: XidRule | None, recent_same_xid: int) -> Decision:
    """What a fault means for a node if it is real: the data-driven tables (cordon kinds, the Xid table)."""
    if finding.kind == Kind.XID:
        rule = xid_rule or XidRule(Action.TREND)
        if rule.action == Action.CORDON:
            cordon, why = True, f"Xid {finding.xid} marks a bad node"
        elif rule.action == Action.TREND and recent_same_xid + 1 >= rule.threshold:
            cordon = True
            why = f"Xid {finding.xid} seen {recent_same_xid + 1} times in {rule.window_minutes} min"
        else:
            cordon, why = False, f"Xid {finding.xid} recorded ({rule.action})"
    else:
        cordon = finding.kind in policy.cordon_kinds
        why = f"{finding.kind} {'cordons' if cordon else 'does not cordon'} by policy"
    return Decision(cordon=cordon, stop_job=cordon and finding.kind in policy.stop_kinds, why=why)


# --- The job's own output ----------------------------------------------------------

_XID_LINE = re.compile(r"\bXid\b\s*(?:\([^)]*\))?\s*:\s*(\d+)\b")
_PATTERNS = [
    (re.compile(r"NCCL.*unhandled (system|cuda) error", re.I), Kind.NCCL, "NCCL reported an unhandled error"),
    (re.compile(r"NCCL WARN.*\bfailed\b", re.I), Kind.NCCL, "NCCL warned of a failure"),
    (re.compile(r"uncorrectable ECC error", re.I), Kind.ECC, "CUDA reported an uncorrectable ECC error"),
    (re.compile(r"fallen off the bus", re.I), Kind.GPU_LOST, "a GPU has fallen off the bus"),
]
_CHEAP = ("NCCL", "ECC", "Xid", "bus")


def scan_line(text: str) -> Finding | None:
    """A health finding in one line of a job's output, or None (most lines)."""
    if not any(word in text for word in _CHEAP):
        return None
    evidence = {"line": text[:500]}
    if match := _XID_LINE.search(text):
        xid = int(match.group(1))
        message = f"Xid {xid} in the job's output"
        return Finding(Kind.XID, "critical", message, xid=xid, evidence=evidence, source=Source.OUTPUT)
    for pattern, kind, message in _PATTERNS:
        if pattern.search(text):
            return Finding(kind, "critical", message, evidence=evidence, source=Source.OUTPUT)
    return None


def storm_repeat(last_same_at: float | None, now: float, window_seconds: float) -> bool:
    """The storm limiter: the same Xid from one GPU's telemetry counts once per window
    (a harmless Xid 45 storm must not flood events, nor count towards a trend)."""
    return last_same_at is not None and now - last_same_at < window_seconds


# --- Telemetry -----------------------------------------------------------------------


def telemetry_findings(previous: dict[int, GpuSample], samples: list[GpuSample]) -> list[Finding]:
    """What changed for the worse since the previous sample of each GPU: a throttle that
    began, ECC counts that grew, a GPU that fell off the bus, Xid events."""
    out = []
    for s in samples:
        before = previous.get(s.index)
        for xid in s.xids:
            out.append(Finding(Kind.XID, "critical", f"GPU {s.index}: Xid {xid}", s.index, xid, {"xid": xid}))
        if s.lost and not (before and before.lost):
            out.append(Finding(Kind.GPU_LOST, "critical", f"GPU {s.index} has fallen off the bus", s.index))
        if s.lost:
            continue
        if s.ecc_uncorrected_volatile > (before.ecc_uncorrected_volatile if before else 0):
            count = s.ecc_uncorrected_volatile
            evidence = {"ecc_uncorrected_volatile": count, "retired_pages_pending": s.retired_pages_pending}
            out.append(
                Finding(
                    Kind.ECC, "critical", f"GPU {s.index}: {count} uncorrectable ECC errors", s.index, None, evidence
                )
            )
        for kind, now, was in (
            (Kind.THERMAL, s.thermal_throttled, before is not None and before.thermal_throttled),
            (Kind.POWER, s.power_throttled, before is not None and before.power_throttled),
        ):
            if now and not was:
                evidence = {"reasons": list(s.throttle_reasons), "temperature_c": s.temperature_c, "power_w": s.power_w}
                out.append(Finding(kind, "warning", f"GPU {s.index}: {kind} throttling", s.index, None, evidence))
    return out


def unhealthy_reason(registered: int, samples: list[GpuSample]) -> tuple[str, dict]:
    """Why a node whose agent reports is still unusable, or "" when it is not: fewer GPUs answer
    than the node registered with, or a GPU has fallen off the bus. (A driver that does not answer
    at all is the agent's to report: it gets no samples.)"""
    lost = sorted(s.index for s in samples if s.lost)
    evidence = {"registered_gpus": registered, "answering_gpus": len(samples) - len(lost), "lost_gpus": lost}
    if len(samples) < registered:
        return f"only {len(samples)} of {registered} registered GPUs answer", evidence
    if lost:
        return f"GPUs {lost} have fallen off the bus", evidence
    return "", evidence
