"""The job page's straggler section: time each rank's node spent throttled, per attempt."""

from django import template

from fleet.charts import throttle_by_rank

register = template.Library()


@register.inclusion_tag("fleet/partials/throttle.html")
def throttle_by_node(job) -> dict:
    """One query for the attempts and one grouped query for their telemetry."""
    attempts = [a for a in job.attempts.select_related("node") if a.running_at is not None]
    by_rank = throttle_by_rank(attempts)
    rows = [(attempt, by_rank[attempt.pk]) for attempt in attempts if attempt.pk in by_rank]
    return {"rows": rows, "multi_node": any(len(ranks) > 1 for _, ranks in rows)}
