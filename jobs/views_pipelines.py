"""The pipeline pages: the runs of the user's projects, and one run's DAG (stages coloured by
state, with durations and cost, each linking to its job), Cancel and Run again."""

import json

from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST
from rest_framework.exceptions import ValidationError

from jobs import pipelines
from jobs.api.pipelines import run_json
from jobs.models import STATE_COLOURS, PipelineRun
from jobs.models.pipeline import CopyState
from portal.api.shape import flatten

COLOURS = {"grey": "#7b8394", "blue": "#2456d6", "green": "#1b8a4a", "red": "#c2352b", "orange": "#c27a12"}


def visible_runs(request):
    runs = PipelineRun.objects.visible_to(request.user).select_related("project", "submitted_by")
    return runs.prefetch_related("stages__job__attempts", "stages__job__cost")


def pipeline_list(request):
    runs = [run_json(run) for run in visible_runs(request)[:100]]
    return render(request, "jobs/pipeline_list.html", {"runs": runs})


def run_context(request, pk: int) -> dict:
    run = get_object_or_404(visible_runs(request), pk=pk)
    body = run_json(run)
    for stage in body["stages"]:
        stage["colour"] = STATE_COLOURS[stage["state"]]
    if copy := body["copy"]:
        state = CopyState(copy["state"])
        copy["label"], copy["colour"] = state.label, state.colour
    return {
        "run": run,
        "body": body,
        "figure": dag_figure(body["stages"]),
        "can_manage": pipelines.can_manage(request.user, run),
        "running": body["state"] == "running",
        "colour": {"running": "blue", "succeeded": "green", "failed": "red", "cancelled": "orange"}[body["state"]],
    }


def pipeline_detail(request, pk: int):
    return render(request, "jobs/pipeline_detail.html", run_context(request, pk))


def pipeline_status(request, pk: int):
    """The DAG and the stages' table: a partial the page refreshes while the run is going."""
    return render(request, "jobs/partials/pipeline_status.html", run_context(request, pk))


@require_POST
def cancel(request, pk: int):
    run = get_object_or_404(visible_runs(request), pk=pk)
    if not pipelines.can_manage(request.user, run):
        messages.error(request, "Only the pipeline's submitter or a project manager can cancel it.")
    else:
        stopped = pipelines.cancel(run, request.user, f"pipeline run {run.pk} cancelled by {request.user}")
        messages.success(request, f"Cancelled stages: {', '.join(stopped) or 'none left to cancel'}.")
    return redirect("pipeline-detail", pk=run.pk)


@require_POST
def rerun(request, pk: int):
    run = get_object_or_404(visible_runs(request), pk=pk)
    try:
        again = pipelines.rerun(request.user, run, request.POST.get("from_stage", "")).run
    except (ValidationError, pipelines.RunNotOver) as refused:
        for error in flatten(refused.detail):
            messages.error(request, f"{error['field']}: {error['message']}" if error["field"] else error["message"])
        return redirect("pipeline-detail", pk=run.pk)
    how = f"from stage {again.from_stage}" if again.from_stage else "all stages"
    messages.success(request, f"Pipeline run {again.pk} started: run {run.pk} again, {how}.")
    return redirect("pipeline-detail", pk=again.pk)


def layers(stages: list[dict]) -> dict[str, tuple[int, int]]:
    """Each stage's column (its longest chain of needs) and row within the column."""
    depth: dict[str, int] = {}
    for stage in stages:  # in topological order
        depth[stage["name"]] = 1 + max((depth[n] for n in stage["needs"]), default=-1)
    rows: dict[int, int] = {}
    place = {}
    for stage in stages:
        column = depth[stage["name"]]
        place[stage["name"]] = (column, rows.get(column, 0))
        rows[column] = rows.get(column, 0) + 1
    return {name: (x, y - (rows[x] - 1) / 2) for name, (x, y) in place.items()}


def label(stage: dict) -> str:
    took = f"{stage['duration_seconds']:.1f} s" if stage["duration_seconds"] is not None else "not started"
    reused = " (reused)" if stage["reused"] else ""
    return f"<b>{stage['name']}</b>{reused}<br>{stage['state']} · {took} · ${stage['cost']:.3f}"


def dag_figure(stages: list[dict]) -> dict:
    """The DAG as a Plotly figure: needs as arrows left to right, stages as markers coloured by
    state; a stage's customdata is its job page (pipeline.js opens it on click)."""
    import plotly.graph_objects as go

    at = layers(stages)
    fig = go.Figure()
    for stage in stages:
        for need in stage["needs"]:
            (x0, y0), (x1, y1) = at[need], at[stage["name"]]
            fig.add_annotation(x=x1, y=y1, ax=x0, ay=y0, xref="x", yref="y", axref="x", ayref="y",
                               showarrow=True, arrowhead=2, arrowwidth=1.5, arrowcolor="#9aa1ad", standoff=18,
                               startstandoff=18, text="")  # fmt: skip
    fig.add_trace(
        go.Scatter(
            x=[at[s["name"]][0] for s in stages],
            y=[at[s["name"]][1] for s in stages],
            mode="markers+text",
            marker={
                "size": 28,
                "color": [COLOURS[STATE_COLOURS[s["state"]]] for s in stages],
                "symbol": ["square" if s["reused"] else "circle" for s in stages],
            },
            text=[label(s) for s in stages],
            textposition="bottom center",
            customdata=[s["urls"]["page"] for s in stages],
            hovertemplate="%{text}<extra>click: open the job</extra>",
        )  # fmt: skip
    )
    columns = max((x for x, _ in at.values()), default=0)
    fig.update_layout(
        showlegend=False,
        height=max(260, 110 * max(1, *[sum(1 for x, _ in at.values() if x == c) for c in range(columns + 1)])),
        margin={"l": 20, "r": 20, "t": 20, "b": 20},
        xaxis={"visible": False, "range": [-0.5, columns + 0.5]},
        yaxis={"visible": False, "autorange": "reversed"},
        plot_bgcolor="#fff",
    )
    return json.loads(fig.to_json())
