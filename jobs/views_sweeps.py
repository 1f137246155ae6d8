"""The sweep pages: every sweep of one's projects, and one sweep's runs sortable by objective
with their parameters, state and cost, and its charts (jobs/sweeps.py)."""

from django.shortcuts import get_object_or_404, render

from jobs import sweeps
from jobs.models import Sweep

SORTS = {
    "objective": lambda runs: runs,  # sweeps.runs ranks them best first
    "-objective": lambda runs: (
        [r for r in runs if r["objective"] is not None][::-1] + [r for r in runs if r["objective"] is None]
    ),
    "index": lambda runs: sorted(runs, key=lambda r: r["index"]),
}


def sweep_list(request):
    found = Sweep.objects.visible_to(request.user).select_related("project", "submitted_by")[:200]
    return render(request, "jobs/sweep_list.html", {"sweeps": found})


def sweep_detail(request, pk: int):
    sweep = get_object_or_404(Sweep.objects.visible_to(request.user).select_related("project"), pk=pk)
    doc = sweeps.document(sweep)
    sort = request.GET.get("sort", "objective")
    names = sweeps.param_names(sweep)
    runs = [
        {**run, "cells": [run["params"].get(n, "") for n in names]}
        for run in SORTS.get(sort, SORTS["objective"])(doc["runs"])
    ]
    context = {
        "sweep": sweep,
        "doc": doc,
        "runs": runs,
        "sort": sort,
        "param_names": names,
        "figures": sweeps.figures(sweep, doc["runs"]) if doc["best"] else None,
    }
    return render(request, "jobs/sweep_detail.html", context)
