"""Who may read what a health event or check took from a job: its project's members and staff.

Nodes are shared by every project, so any signed-in user sees a node's events, checks
and cordon history; but an event found in a job's output carries that job's printed
line and its attempt, and a check run for a job names the job. For anyone else those
are replaced by "a job of another project" (what happened to the node stays readable).
Used by the node page and the node API alike.
"""

from portal.models import Project

OTHER_PROJECT = "a job of another project"
# Evidence keys whose values come from a job's own output (fleet.health's output findings).
OUTPUT_KEYS = ("line",)


def attempt_model():
    from fleet.models import HealthEvent

    return HealthEvent._meta.get_field("attempt").related_model  # jobs.Attempt, without importing jobs


def readable_attempts(user, attempt_ids) -> set[int]:
    """The attempts among `attempt_ids` whose job `user` may see (all of them for staff)."""
    ids = {pk for pk in attempt_ids if pk}
    if not ids or user.is_staff:
        return ids
    visible = attempt_model().objects.filter(pk__in=ids, job__project__in=Project.objects.visible_to(user))
    return set(visible.values_list("pk", flat=True))


# Where a job's report came from (agent/watch.py): ids of another project's attempt and user.
SOURCE_KEYS = ("attempt", "user", "rank", "rank_seq")


def redacted(evidence: dict) -> dict:
    out = {key: value for key, value in evidence.items() if key not in OUTPUT_KEYS + SOURCE_KEYS}
    if any(key in evidence for key in OUTPUT_KEYS):
        out["line"] = f"(printed by {OTHER_PROJECT})"
    out["job"] = OTHER_PROJECT
    return out


def attempt_refs(value) -> set[int]:
    """The attempts a piece of evidence cites at any depth (a cordon's evidence lists the other
    events that agree with it, each with the attempt whose output it came from)."""
    if isinstance(value, list):
        return set().union(*(attempt_refs(v) for v in value)) if value else set()
    if not isinstance(value, dict):
        return set()
    found = {value["attempt"]} if isinstance(value.get("attempt"), int) else set()
    return found.union(*(attempt_refs(v) for v in value.values()))


def scrubbed(value, readable: set[int]):
    """`value` with every piece that cites an attempt outside `readable` redacted."""
    if isinstance(value, list):
        return [scrubbed(v, readable) for v in value]
    if not isinstance(value, dict):
        return value
    out = {key: scrubbed(v, readable) for key, v in value.items()}
    cited = value.get("attempt")
    return redacted(out) if isinstance(cited, int) and cited not in readable else out


def redact(rows, user, evidence_is_dict: bool = True) -> list:
    """Health events or checks as `user` may see them: others' attempts and output replaced.
    Sets `other_project` on each row (True where something was hidden); never saved."""
    rows = list(rows)
    cited = set().union(*(attempt_refs(row.evidence) for row in rows)) if evidence_is_dict and rows else set()
    readable = readable_attempts(user, {row.attempt_id for row in rows} | cited)
    for row in rows:
        row.other_project = bool(row.attempt_id) and row.attempt_id not in readable
        if evidence_is_dict and isinstance(row.evidence, dict):
            row.evidence = scrubbed(row.evidence, readable)
        if row.other_project:
            row.attempt_id = None
            if evidence_is_dict and isinstance(row.evidence, dict):
                row.evidence = redacted(row.evidence)
    return rows


def redact_history(history, user) -> list:
    """Cordon history rows: an automatic cordon's evidence names the health event it came from."""
    history = list(history)
    rows = [row for row in history if isinstance(row.detail, dict) and isinstance(row.detail.get("evidence"), dict)]
    seen = redact_cordon_evidence([row.detail["evidence"] for row in rows], user)
    for row, evidence in zip(rows, seen, strict=True):
        row.detail = {**row.detail, "evidence": evidence}
    return history


def redact_cordon_evidence(evidences: list[dict], user) -> list[dict]:
    """Cordons' evidence as `user` may see it (a node page's history, a node.cordoned webhook):
    what another project's attempt printed, and its ids, replaced."""
    from fleet.models import HealthEvent

    event_ids = {evidence.get("health_event") for evidence in evidences}
    attempts = dict(HealthEvent.objects.filter(pk__in=event_ids - {None}).values_list("pk", "attempt_id"))
    cited = set().union(*(attempt_refs(evidence) for evidence in evidences)) if evidences else set()
    readable = readable_attempts(user, set(attempts.values()) | cited)
    out = []
    for evidence in evidences:
        seen = scrubbed(evidence, readable)
        attempt_id = attempts.get(seen.get("health_event"))
        out.append(redacted(seen) if attempt_id and attempt_id not in readable else seen)
    return out
