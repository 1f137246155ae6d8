from django import template

from jobs import reproduce, tracking
from jobs.costs import job_cost
from jobs.models import attempt_cost_of

register = template.Library()


def cost_context(job) -> dict:
    """The Cost card's: each attempt's cost so far and the job's total (jobs/partials/job_cost.html)."""
    costs = [(a, attempt_cost_of(a)) for a in job.attempts.select_related("node", "job")]
    return {"job": job, "costs": costs, "total_cost": job_cost([c for _, c in costs])}


@register.inclusion_tag("jobs/partials/job_experiment.html", takes_context=True)
def job_experiment(context, job):
    """The job page's metrics chart, MLflow link, reproduce record and run-again / compare actions."""
    return {
        **cost_context(job),
        "record": reproduce.record(job),
        "mlflow_ui": tracking.ui_url(job),
        "csrf_token": context.get("csrf_token"),
    }
