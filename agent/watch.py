"""Watching a running job for faults: findings in its own output (NCCL, ECC, Xid lines)
and in the node's telemetry, recorded as health events; when the policy says so, the
attempts they hit are stopped (infra: they are requeued)."""

import dataclasses
import logging
import threading

from agent.recheck import recheck
from agent.running import running
from fleet import health
from fleet.models import HealthEvent, Node
from jobs.models import AttemptState, FailureClass

log = logging.getLogger("hangar.agent")


def handle_finding(node: Node, finding: health.Finding, attempt=None) -> HealthEvent:
    """Record a finding; when the policy says so, stop the attempts it hit (infra: they are requeued).
    A finding from a job's output is first re-checked on the node's GPUs (agent/recheck.py)."""
    checked = None
    if finding.source == health.Source.OUTPUT:
        checked = recheck(node, list(getattr(attempt, "gpu_indices", None) or []), attempt)
    event, decision = HealthEvent.record(node, finding, attempt, checked)
    if decision.stop_job:
        for runner in running():
            hit = runner.attempt.pk == getattr(attempt, "pk", None) or (
                attempt is None and (finding.gpu_index is None or finding.gpu_index in runner.attempt.gpu_indices)
            )
            if hit and runner.attempt.node_id == node.pk:
                runner.request_stop(AttemptState.FAILED, FailureClass.INFRA, f"health: {finding.message}")
    return event


# Per running attempt, the (kind, xid) already recorded from its output: a job that prints the
# same NCCL error a thousand times makes one health event, not a thousand. An attempt's entry
# goes when its runner ends (`forget`), so a long-lived agent keeps only its running attempts'.
_seen_in_output: dict[int, set[tuple[str, int | None]]] = {}
_seen_lock = threading.Lock()


def observe_output(attempt, text: str, rank: int = 0, rank_seq: int | None = None) -> None:
    """Called for each line of a job's output: NCCL, ECC and Xid errors in it are suspicions
    (see `health.weigh_suspicion`), recorded with where the line came from."""
    finding = health.scan_line(text)
    if finding is None:
        return
    key = (finding.kind, finding.xid)
    with _seen_lock:
        seen = _seen_in_output.setdefault(attempt.pk, set())
        if key in seen:
            return
        seen.add(key)
    where = {"attempt": attempt.pk, "rank": rank, "rank_seq": rank_seq, "user": attempt.job.submitted_by_id}
    finding = dataclasses.replace(finding, evidence={**finding.evidence, **where})
    try:
        handle_finding(attempt.node, finding, attempt)
    except Exception:  # runs on the log writer's thread: never let it die over a finding
        log.exception("attempt %s: health finding not recorded", attempt.pk)


def forget(attempt_id: int) -> None:
    """The attempt's runner ended on this agent: its findings need no more deduplication."""
    with _seen_lock:
        _seen_in_output.pop(attempt_id, None)
