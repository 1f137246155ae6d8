"""Run a job again with the same spec, and compare two jobs side by side."""

from django.contrib import messages
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError

from jobs import jobspec, reproduce, tracking
from jobs.api.serializers import JobSubmitSerializer
from jobs.models import JobCost
from jobs.views import visible_job
from portal.api.shape import flatten


@require_POST
def run_again(request, pk: int):
    job = visible_job(request, pk)
    spec = jobspec.copy_for(job, reproduce.clone_data(job), request.user, None)  # another user's: no secrets
    serializer = JobSubmitSerializer(data=spec, context={"request": request, "copy_of": job})
    try:
        serializer.is_valid(raise_exception=True)
        clone = serializer.save()
    except ValidationError as refused:
        problems = "; ".join(f"{e['field']}: {e['message']}" for e in flatten(refused.detail))
        messages.error(request, f"Could not run job {job.pk} again: {problems}")
        return redirect("job-detail", pk=job.pk)
    messages.success(request, f"Job {clone.pk} submitted: the spec of job {job.pk} run again.")
    return redirect("job-detail", pk=clone.pk)


def compare(request):
    try:
        a, b = (visible_job(request, int(request.GET.get(k, ""))) for k in ("a", "b"))
    except ValueError:
        messages.error(request, "Give two job ids to compare, e.g. ?a=12&b=15.")
        return redirect("job-list")
    return render(request, "jobs/compare.html", comparison(a, b))


def comparison(a, b) -> dict:
    spec_a, spec_b = reproduce.record(a), reproduce.record(b)
    fields = [*reproduce.SPEC_FIELDS, "placement"]
    metrics_a, metrics_b = tracking.metrics(a), tracking.metrics(b)
    final_a, final_b = reproduce.final_metrics(metrics_a["series"]), reproduce.final_metrics(metrics_b["series"])
    costs = dict(JobCost.objects.filter(pk__in=[a.pk, b.pk]).values_list("pk", "cost"))
    outcome_a = {"state": a.state, "exit_code": a.exit_code, "cost": costs.get(a.pk)}
    outcome_b = {"state": b.state, "exit_code": b.exit_code, "cost": costs.get(b.pk)}
    return {
        "a": a,
        "b": b,
        "spec": reproduce.diff(spec_a, spec_b, fields),
        "metrics": reproduce.diff(final_a, final_b, sorted(set(final_a) | set(final_b))),
        "outcome": reproduce.diff(outcome_a, outcome_b, ["state", "exit_code", "cost"]),
        "unavailable": [m["reason"] for m in (metrics_a, metrics_b) if not m["available"]],
    }
