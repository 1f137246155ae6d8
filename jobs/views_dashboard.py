"""The dashboard: the fleet at a glance, the queue, and the latest jobs of the user's projects."""

from django.shortcuts import render

from fleet.models import Node
from jobs.models import Job, JobState


def dashboard_context(request) -> dict:
    jobs = Job.objects.visible_to(request.user).select_related("project", "submitted_by")
    nodes = Node.objects.prefetch_related("gpus")
    return {
        "nodes": nodes,
        "any_simulated": any(n.simulated for n in nodes),
        "queued": jobs.filter(state=JobState.QUEUED).order_by("queued_at", "id")[:50],
        "recent": jobs[:20],
    }


def dashboard(request):
    return render(request, "portal/dashboard.html", dashboard_context(request))


def dashboard_panels(request):
    """The dashboard's live part, swapped in by htmx every few seconds."""
    return render(request, "portal/partials/dashboard_panels.html", dashboard_context(request))
