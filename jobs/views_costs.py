"""Cost pages for managers and members: the overview (roll-ups, charts, budgets),
the per-job table, and CSV exports of both, streamed."""

import csv

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import StreamingHttpResponse
from django.shortcuts import render
from django.utils import timezone

from fleet.models import Node
from jobs import costreports
from jobs.api.costs import budget_warning
from jobs.costreports import CostFilter
from jobs.models import GpuRate, JobState

PAGE_SIZE = 50
OVERVIEW_DAYS = 31
TABLE_TITLES = {"project": "By project", "user": "By user", "gpu_type": "By GPU type", "day": "By day (latest first)"}


def filter_context(request, f: CostFilter) -> dict:
    projects = costreports.cost_projects(request.user)
    gpu_types = sorted(
        set(costreports.CostDaily.objects.filter(project__in=projects).values_list("gpu_type", flat=True))
    )
    fleet_types = set(Node.objects.values_list("gpu_model", flat=True)) - {"none"}
    return {
        "unpriced": GpuRate.unpriced(fleet_types),
        "example_rates": GpuRate.examples_in_force(fleet_types),
        "f": f,
        "projects": projects,
        "gpu_types": gpu_types,
        "states": JobState.choices,
        "query": "&".join(f"{k}={v}" for k, v in f.query().items()),
    }


def overview(request):
    f = CostFilter.from_params(request.GET)
    tables = [(title, by, costreports.rollup(request.user, f, by)) for by, title in TABLE_TITLES.items()]
    tables[-1] = (*tables[-1][:2], tables[-1][2][:OVERVIEW_DAYS])  # the latest days
    context = {
        **filter_context(request, f),
        "totals": costreports.totals(request.user, f),
        "budgets": costreports.budgets(request.user, f),
        "figures": costreports.as_json(costreports.figures(request.user, f)),
        "tables": tables,
        "columns": ["attempts", "gpu_hours", "preflight_cost", "running_cost", "cost", "wasted_cost"],
    }
    return render(request, "costs/overview.html", context)


def jobs(request):
    f = CostFilter.from_params(request.GET)
    page = Paginator(costreports.job_table(request.user, f), PAGE_SIZE).get_page(request.GET.get("page"))
    rows = list(costreports.job_rows(page.object_list))
    context = {
        **filter_context(request, f),
        "page": page,
        "rows": [[row[c] for c in costreports.JOB_COLUMNS] for row in rows],
        "columns": costreports.JOB_COLUMNS,
        "sorts": costreports.SORTS,
        "budgets": costreports.budgets(request.user, f),
    }
    return render(request, "costs/jobs.html", context)


def warn_budget(request, project) -> None:
    """After a submission: say so when the project's budget for this month is nearly (or all) spent."""
    if warning := budget_warning(project):
        messages.warning(request, warning)


class Echo:
    def write(self, value: str) -> str:
        return value


# A text cell a spreadsheet would read as a formula (a job named `=HYPERLINK(...)`).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(value):
    """A text cell starting like a formula gets a leading `'`, so it is shown as text (OWASP's
    CSV injection advice); numbers are left as they are."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def stream_csv(name: str, header: list[str], rows) -> StreamingHttpResponse:
    writer = csv.writer(Echo())
    lines = (writer.writerow([spreadsheet_safe(cell) for cell in row]) for row in _with_header(header, rows))
    response = StreamingHttpResponse(lines, content_type="text/csv")
    stamp = timezone.now().strftime("%Y%m%d-%H%M")
    response["Content-Disposition"] = f'attachment; filename="hangar-{name}-{stamp}.csv"'
    return response


def _with_header(header, rows):
    yield header
    yield from rows


def jobs_csv(request):
    """Every row of the per-job table under the same filters and sort, not just one page."""
    f = CostFilter.from_params(request.GET)
    table = costreports.job_table(request.user, f)
    rows = ([row[c] for c in costreports.JOB_COLUMNS] for row in costreports.job_rows(table))
    return stream_csv("job-costs", costreports.JOB_COLUMNS, rows)


def rollup_csv(request):
    f = CostFilter.from_params(request.GET)
    by = request.GET.get("by", "project")
    if by not in costreports.ROLLUPS:
        by = "project"
    header = [by, "attempts", "gpu_hours", "preflight_cost", "running_cost", "cost", "wasted_cost"]
    rows = ([row[c] for c in header] for row in costreports.rollup(request.user, f, by))
    return stream_csv(f"costs-by-{by}", header, rows)
