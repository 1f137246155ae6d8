from django.conf import settings
from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError

from jobs.api.serializers import JobSubmitSerializer
from jobs.api.views import can_cancel, movable_jobs, queue_state
from jobs.forms import JobForm
from jobs.models import Job
from jobs.templatetags.experiments import cost_context
from jobs.views_costs import warn_budget


def visible_job(request, pk: int) -> Job:
    return get_object_or_404(Job.objects.visible_to(request.user).select_related("project", "submitted_by"), pk=pk)


def job_list(request):
    jobs = Job.objects.visible_to(request.user).select_related("project", "submitted_by")[:200]
    return render(request, "jobs/job_list.html", {"jobs": jobs})


def submit(request):
    form = JobForm(request.user, request.POST or None)
    if request.method == "POST" and form.is_valid():
        serializer = JobSubmitSerializer(data=form.api_data(), context={"request": request})
        try:
            serializer.is_valid(raise_exception=True)
            job = serializer.save()
        except ValidationError as refused:
            form.add_api_errors(refused.detail)
        else:
            messages.success(request, f"Job {job.pk} submitted.")
            warn_budget(request, job.project)
            return redirect("job-detail", pk=job.pk)
    return render(request, "jobs/job_submit.html", {"form": form})


def status_context(request, job: Job) -> dict:
    from jobs.api.serializers import diagnosis_of, hang_of

    latest = job.latest_attempt()
    return {
        "job": job,
        "latest": latest,
        "diagnosis": diagnosis_of(latest),
        "hang": hang_of(latest) if latest is not None and latest.state == "running" else None,
        "straggler": hang_of(latest, "straggler") if latest is not None and latest.state == "running" else None,
        "attempts": job.attempts.select_related("node"),
        "events": job.events.all(),
        "can_cancel": not job.is_final and can_cancel(request.user, job),
    }


def job_detail(request, pk: int):
    job = visible_job(request, pk)
    context = {**status_context(request, job), "log_view_lines": settings.HANGAR_LOG_VIEW_LINES}
    return render(request, "jobs/job_detail.html", context)


def job_cost_card(request, pk: int):
    """The job's Cost card: a partial the page refreshes when the job's state changes (and while it runs)."""
    job = visible_job(request, pk)
    return render(request, "jobs/partials/job_cost.html", cost_context(job))


def job_status(request, pk: int):
    """The job's state, attempts and history: a partial the page refreshes with htmx."""
    job = visible_job(request, pk)
    return render(request, "jobs/partials/job_status.html", status_context(request, job))


@require_POST
def cancel(request, pk: int):
    job = visible_job(request, pk)
    if can_cancel(request.user, job):
        job.cancel(request.user, f"cancelled by {request.user} from the job page")
    else:
        messages.error(request, "Only the job's submitter or a project manager can cancel it.")
    if request.headers.get("HX-Request"):
        return render(request, "jobs/partials/job_status.html", status_context(request, job))
    return redirect("job-detail", pk=job.pk)


def queue(request):
    return render(request, "jobs/queue.html", {"queue": queue_state(request.user)})


def queue_panel(request):
    """The waiting and running tables: a partial the queue page refreshes with htmx."""
    return render(request, "jobs/partials/queue_tables.html", {"queue": queue_state(request.user)})


@require_POST
def move(request, pk: int):
    job = visible_job(request, pk)
    movable = movable_jobs(request.user)
    if request.POST.get("direction") in ("up", "down") and movable.filter(pk=job.pk).exists():
        job.move(request.user, request.POST["direction"], movable)
    else:
        messages.error(request, "Only the job's submitter or a project manager can move it.")
    if request.headers.get("HX-Request"):
        return queue_panel(request)
    return redirect("job-queue")
