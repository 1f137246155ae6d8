"""The evidence that corroborates (or not) a fault seen in a job's output, loaded for `health.decide`.

A job is untrusted: a line it prints is a suspicion. What backs it comes from
elsewhere: the agent's immediate re-check of the node's GPUs (passed in by the
agent), the driver's own reports (telemetry events on the node within the
window), and jobs of other users or projects reporting the same on the node.
"""

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from fleet import health
from fleet.models import HealthEvent, Node, XidPolicy

# The node's own reports that corroborate a job's (NCCL: the simulator's injected failures).
DRIVER_KINDS = (health.Kind.XID, health.Kind.ECC, health.Kind.GPU_LOST, health.Kind.NCCL)


def window_start():
    return timezone.now() - timedelta(seconds=settings.HANGAR_CORROBORATION_WINDOW_SECONDS)


def counted_since(node: Node):
    """Evidence counts within the window, and only since the node last returned to service: what
    came before a burn-in (or an operator's override) was dealt with then."""
    start = window_start()
    state, changed = Node.objects.filter(pk=node.pk).values_list("state", "state_changed_at").first() or ("", None)
    if state == "ready" and changed is not None and changed > start:
        return changed
    return start


def load(node: Node, finding: health.Finding, attempt, recheck: tuple[bool, list[str]] | None):
    """The corroboration of a finding from a job's output; None for the driver's own findings."""
    if finding.source != health.Source.OUTPUT:
        return None
    ran, failures = recheck or (False, [])
    return health.Corroboration(
        recheck_failures=tuple(failures),
        rechecked=ran,
        driver_reports=tuple(driver_reports(node, attempt)),
        reporters=reporters(node, finding, attempt),
        needed_reporters=settings.HANGAR_CORROBORATION_USERS,
        window_seconds=settings.HANGAR_CORROBORATION_WINDOW_SECONDS,
        reported_first_on=reported_first_on(node, finding, attempt),
        follows_job=follows_job(node, finding, attempt),
    )


def same_output_finding(finding: health.Finding):
    same = HealthEvent.objects.filter(source=health.Source.OUTPUT, kind=finding.kind)
    return same.filter(xid=finding.xid) if finding.xid is not None else same


def driver_reports(node: Node, attempt) -> list[str]:
    """What the node's driver reported on the attempt's GPUs within the window (Xids the table
    calls the application's own excepted)."""
    events = HealthEvent.objects.filter(
        node=node, source=health.Source.TELEMETRY, kind__in=DRIVER_KINDS, at__gte=counted_since(node)
    )
    gpus = list(getattr(attempt, "gpu_indices", None) or [])
    if gpus:
        events = events.filter(gpu_index__in=gpus) | events.filter(gpu_index__isnull=True, node=node)
    out = []
    for event in events.order_by("at")[:20]:
        if event.xid is not None and XidPolicy.rule_for(event.xid).action == health.Action.IGNORE:
            continue
        out.append(f"{event.message} (health event {event.pk})")
    return out


def reporters(node: Node, finding: health.Finding, attempt) -> int:
    """Distinct users, or projects if more, whose jobs reported this finding on the node within the
    window, this attempt's included. Follow-on reports of another node's fault do not count."""
    rows = (
        same_output_finding(finding)
        .filter(node=node, at__gte=counted_since(node), attempt__isnull=False)
        .exclude(evidence__has_key="reported_first_on")
        .values_list("attempt__job__submitted_by_id", "attempt__job__project_id")
    )
    pairs = set(rows)
    if attempt is not None:
        pairs.add((attempt.job.submitted_by_id, attempt.job.project_id))
    return max(len({u for u, _ in pairs}), len({p for _, p in pairs}), 1)


def reported_first_on(node: Node, finding: health.Finding, attempt) -> str:
    """For a multi-node attempt: another rank's node reported the same finding first."""
    if attempt is None or len(getattr(attempt, "placement", None) or []) < 2:
        return ""
    first = same_output_finding(finding).filter(attempt_id=attempt.pk).exclude(node=node).order_by("at").first()
    return f"node {first.node.name} (health event {first.pk})" if first else ""


def follows_job(node: Node, finding: health.Finding, attempt) -> str:
    """The same job reported the same finding on another node in an earlier attempt."""
    if attempt is None:
        return ""
    earlier = (
        same_output_finding(finding)
        .filter(attempt__job_id=attempt.job_id)
        .exclude(attempt_id=attempt.pk)
        .exclude(node=node)
        .order_by("at")
        .first()
    )
    return f"job {attempt.job_id} reported it on node {earlier.node.name} too" if earlier else ""


def refs(backing: health.Corroboration | None, decision: health.Decision) -> dict:
    """What the event stores of its corroboration, so that the event says why it did or did not cordon."""
    if backing is None:
        return {}
    out: dict = {"corroborated_by": list(decision.evidence)} if decision.cordon else {}
    if backing.reported_first_on:
        out["reported_first_on"] = backing.reported_first_on
    if backing.recheck_failures:
        out["recheck_failures"] = list(backing.recheck_failures)
    out["rechecked"] = backing.rechecked
    out["reporters"] = backing.reporters
    return out


def cordon_evidence(node: Node, event: HealthEvent) -> dict:
    """A cordon names all its evidence: the event that decided it, and the other events on the node
    within the window (job output suspicions and driver reports) that agree with it."""
    related = HealthEvent.objects.filter(node=node, at__gte=window_start(), kind__in=DRIVER_KINDS)
    pieces = [
        {"health_event": e.pk, "source": e.source, "kind": e.kind, "message": e.message, **_line(e)}
        for e in related.exclude(pk=event.pk).order_by("at")[:10]
    ]
    return {**event.evidence, "source": event.source, "related_events": pieces}


def also_seen(evidence: dict) -> str:
    """For a cordon's reason: the other evidence on the node that agrees, from the other source."""
    other = [e for e in evidence["related_events"] if e["source"] != evidence["source"]][:3]
    if not other:
        return ""
    return "; also " + "; ".join(f"{e['message']} ({e['source']}, health event {e['health_event']})" for e in other)


def _line(event: HealthEvent) -> dict:
    keep = ("line", "attempt", "rank", "rank_seq", "user")
    return {k: event.evidence[k] for k in keep if k in event.evidence}


def storm_repeat(node: Node, finding: health.Finding) -> HealthEvent | None:
    """The same Xid from the same GPU's telemetry within the storm window: the earlier event, its
    repeat counted on it, instead of a new event (and no new decision)."""
    if finding.kind != health.Kind.XID or finding.source != health.Source.TELEMETRY:
        return None
    window = settings.HANGAR_XID_STORM_SECONDS
    last = (
        HealthEvent.objects.filter(node=node, kind=health.Kind.XID, xid=finding.xid, gpu_index=finding.gpu_index)
        .filter(source=health.Source.TELEMETRY)
        .order_by("-at")
        .first()
    )
    now = timezone.now()
    if last is None or not health.storm_repeat(last.at.timestamp(), now.timestamp(), window):
        return None
    last.evidence = {**last.evidence, "repeats": int(last.evidence.get("repeats", 0)) + 1}
    last.save(update_fields=["evidence"])
    return last
