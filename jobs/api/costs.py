"""The cost API: `/api/v1/costs/summary/`, `/api/v1/costs/jobs/`, and the budget check at submit."""

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs import costreports
from jobs.models import Budget, JobState
from portal.api.pagination import LIMIT_SCHEMA, OFFSET_SCHEMA, Pagination
from portal.api.schema import or_empty
from portal.remembered import forget_on_change, remembered


def budget_status(project):
    """This month's spend against the project's budget, or None without a budget."""
    today = timezone.now().date()
    budget = Budget.for_month(project.pk, today)
    return None if budget is None else budget.status(today)


def budget_warning(project, status=None) -> str | None:
    """What to tell a submitter when the project's budget for this month is nearly (or all) spent."""
    status = status or budget_status(project)
    if status is not None and status.warning:
        return f"Budget warning: {status.message()}."
    return None


BUDGETED_SECONDS = 5.0
BUDGETED = "budgeted-projects"


def budgeted_projects() -> frozenset[int]:
    """Ids of the projects with a budget this month, remembered for BUDGETED_SECONDS
    (portal.remembered): a submit to a project without one (most) reads no budget. A budget
    set through another web process, or a new month's, counts within BUDGETED_SECONDS."""
    return remembered(BUDGETED, read_budgeted_projects, BUDGETED_SECONDS)


def read_budgeted_projects() -> frozenset[int]:
    return frozenset(Budget.applying(timezone.now().date()).values_list("project_id", flat=True))


forget_on_change(BUDGETED, Budget)


def check_budget(project) -> str | None:
    """Refuse a submission to a project whose hard budget for this month is spent; else
    the warning to give the submitter, if any (one read of the budget serves both)."""
    if project.pk not in budgeted_projects():
        return None
    status = budget_status(project)
    if status is not None and status.refuses:
        raise serializers.ValidationError(
            {
                "project": f"{status.message()}: it is a hard limit, so no new jobs run in {project.slug} "
                "this month; ask a manager of the project to raise the budget"
            }
        )
    return budget_warning(project, status) if status is not None else None


def cost_filter(request) -> costreports.CostFilter:
    f = costreports.CostFilter.from_params(request.query_params)
    if f.errors:
        raise serializers.ValidationError(f.errors)
    return f


SORT_KEYS = sorted([*costreports.SORTS, *(f"-{key}" for key in costreports.SORTS)])
COST_FILTERS = [
    *(OpenApiParameter(name, str) for name in ("project", "user", "gpu_type")),
    OpenApiParameter("state", enum=["", *JobState.values]),
    OpenApiParameter("date_from", or_empty({"type": "string", "format": "date"})),
    OpenApiParameter("date_to", or_empty({"type": "string", "format": "date"})),
    OpenApiParameter("sort", enum=["", *SORT_KEYS]),
]


class CostSummaryView(APIView):
    """Totals, budgets and one roll-up: ?by=project|user|gpu_type|day|label plus the job table's filters."""

    @extend_schema(
        parameters=[*COST_FILTERS, OpenApiParameter("by", enum=list(costreports.ROLLUPS))],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request):
        f = cost_filter(request)
        by = request.query_params.get("by", "project")
        if by not in costreports.ROLLUPS:
            raise serializers.ValidationError({"by": f"{by!r}: use one of {', '.join(costreports.ROLLUPS)}"})
        return Response(
            {
                "totals": costreports.totals(request.user, f),
                "budgets": [budget_json(b) for b in costreports.budgets(request.user, f)],
                "by": by,
                "rows": costreports.rollup(request.user, f, by),
            }
        )


class CostJobsView(APIView):
    """The per-job cost table: filters project, user, gpu_type, state, date_from, date_to; sort; limit/offset."""

    @extend_schema(
        parameters=[*COST_FILTERS, OpenApiParameter("limit", LIMIT_SCHEMA), OpenApiParameter("offset", OFFSET_SCHEMA)],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request):
        jobs = costreports.job_table(request.user, cost_filter(request))
        paginator = Pagination()
        limit, offset = paginator.get_limit(request), paginator.get_offset(request)
        count = jobs.count()
        rows = list(costreports.job_rows(jobs[offset : offset + limit]))
        more = offset + limit < count
        return Response({"count": count, "limit": limit, "offset": offset, "more": more, "results": rows})


def budget_json(status) -> dict:
    return {
        "name": status.name.strip("'"),
        "amount": f"{status.amount:.2f}",
        "spent": f"{status.spent:.2f}",
        "left": f"{status.left:.2f}",
        "used_percent": round(status.used_percent, 1),
        "warning": status.warning,
        "hard_limit": status.hard_limit,
        "exhausted": status.exhausted,
    }
