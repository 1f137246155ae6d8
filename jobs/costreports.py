"""Cost reports: the per-job table, the roll-ups and the charts, shared by the cost
pages, the cost API and the CSV export. Every query starts from the projects the
caller may see costs of, and aggregates in the database.
"""

import json
from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal
from itertools import islice

from django.db.models import DecimalField, F, Q, QuerySet, Sum, Value
from django.db.models.functions import Coalesce
from django.http import Http404
from django.utils import timezone

from jobs.costs import WASTED_LABELS, wasted_share
from jobs.models import FINAL_JOB_STATES, Attempt, Budget, CostDaily, GpuRate, Job, JobState, attempt_cost_of
from portal.models import Project, Role

ROLLUPS = {"project": "project__slug", "user": "user__username", "gpu_type": "gpu_type", "day": "day", "label": "label"}
SORTS = {
    "cost": "total",
    "wasted": "wasted",
    "gpu_hours": "gpu_seconds",
    "created": "created_at",
    "job": "id",
}
JOB_COLUMNS = [
    "job",
    "name",
    "project",
    "user",
    "gpu_type",
    "state",
    "created",
    "attempts",
    "gpu_hours",
    "preflight_cost",
    "running_cost",
    "cost",
    "wasted_cost",
]
ZERO = Value(Decimal(0), output_field=DecimalField(max_digits=14, decimal_places=4))


def cost_projects(user) -> QuerySet:
    """Projects whose costs the user may see: members see their projects', managers and admins theirs."""
    return Project.objects.with_role(user, Role.MEMBER)


@dataclass
class CostFilter:
    project: str = ""
    user: str = ""
    gpu_type: str = ""
    state: str = ""
    date_from: date | None = None
    date_to: date | None = None
    sort: str = "-cost"
    errors: dict = field(default_factory=dict)

    @classmethod
    def from_params(cls, params) -> "CostFilter":
        f = cls(**{k: params.get(k, "").strip() for k in ("project", "user", "gpu_type", "state")})
        for name in ("date_from", "date_to"):
            raw = params.get(name, "").strip()
            if raw:
                try:
                    setattr(f, name, date.fromisoformat(raw))
                except ValueError:
                    f.errors[name] = f"{raw!r} is not a date; use YYYY-MM-DD"
        sort = params.get("sort", "-cost").strip() or "-cost"
        if sort.lstrip("-") not in SORTS:
            f.errors["sort"] = f"{sort!r} is not a sort key; use one of {', '.join(SORTS)} (prefix '-' for descending)"
        else:
            f.sort = sort
        if f.state and f.state not in JobState.values:
            f.errors["state"] = f"{f.state!r} is not a job state; use one of {', '.join(JobState.values)}"
        return f

    def query(self) -> dict[str, str]:
        values = {k: getattr(self, k) for k in ("project", "user", "gpu_type", "state", "date_from", "date_to")}
        return {k: str(v) for k, v in values.items() if v}

    def projects(self, user) -> QuerySet:
        """The visible projects, narrowed to the one asked for; asking for one you cannot see is a 404."""
        projects = cost_projects(user)
        if self.project:
            projects = projects.filter(slug=self.project)
            if not projects.exists():
                raise Http404(f"no project {self.project!r} whose costs you can see")
        return projects


def narrow(rows: QuerySet, f: CostFilter, user: str, gpu_type: str, day: str, state: str = "") -> QuerySet:
    """Apply the filter's user, GPU type, state and dates through the given lookups of `rows`' model."""
    wanted = {user: f.user, gpu_type: f.gpu_type, state: f.state, f"{day}__gte": f.date_from, f"{day}__lte": f.date_to}
    return rows.filter(**{lookup: value for lookup, value in wanted.items() if lookup and value})


def job_table(user, f: CostFilter) -> QuerySet:
    jobs = narrow(
        Job.objects.filter(project__in=f.projects(user)), f,
        user="submitted_by__username", gpu_type="cost__gpu_type", day="created_at__date", state="state",
    )  # fmt: skip
    jobs = jobs.annotate(
        total=Coalesce(F("cost__cost"), ZERO),
        wasted=Coalesce(F("cost__wasted_cost"), ZERO),
        gpu_seconds=Coalesce(F("cost__gpu_seconds"), Value(0.0)),
    )
    key = SORTS[f.sort.lstrip("-")]
    order = F(key).desc() if f.sort.startswith("-") else F(key).asc()
    return jobs.order_by(order, "-id")


ROW_FIELDS = (
    "id",
    "name",
    "project__slug",
    "submitted_by__username",
    "gpu_type",
    "state",
    "created_at",
    "cost__gpu_type",
    "cost__attempts",
    "cost__gpu_seconds",
    "cost__preflight_cost",
    "cost__running_cost",
    "cost__wasted_cost",
)


def job_rows(jobs: QuerySet, chunk_size: int = 2000):
    """Lines of the per-job table, as shown, sent by the API and written to CSV. Jobs
    still running are costed so far: their live attempts are read once per chunk."""
    values = jobs.values(*ROW_FIELDS).iterator(chunk_size=chunk_size)
    rates: dict[str, list] = {}
    while chunk := list(islice(values, chunk_size)):
        live = live_attempts([v["id"] for v in chunk if v["state"] not in (*FINAL_JOB_STATES, JobState.QUEUED)])
        for v in chunk:
            attempt = live.get(v["id"])
            if attempt is not None and attempt.node.gpu_model not in rates:
                rates[attempt.node.gpu_model] = GpuRate.rates_for(attempt.node.gpu_model)
            yield job_row(v, attempt, rates.get(attempt.node.gpu_model) if attempt else None)


def live_attempts(job_ids: list[int]) -> dict[int, Attempt]:
    if not job_ids:
        return {}
    rows = Attempt.objects.select_related("node", "job").filter(job_id__in=job_ids, finished_at=None)
    return {a.job_id: a for a in rows}


def job_row(v: dict, live: Attempt | None = None, rates: list | None = None) -> dict:
    """One line of the per-job table from a job's values; a job still running adds its
    live attempt's cost so far (no cost row yet means no attempt of it has finished)."""
    preflight = v["cost__preflight_cost"] or Decimal(0)
    running = v["cost__running_cost"] or Decimal(0)
    gpu_seconds, attempts = v["cost__gpu_seconds"] or 0.0, v["cost__attempts"] or 0
    gpu_type = v["cost__gpu_type"] or v["gpu_type"]
    if live is not None:
        so_far = attempt_cost_of(live, rates=rates)
        preflight, running = preflight + so_far.preflight_cost, running + so_far.running_cost
        gpu_seconds, attempts, gpu_type = gpu_seconds + so_far.gpu_seconds, attempts + 1, live.node.gpu_model
    return {
        "job": v["id"],
        "name": v["name"],
        "project": v["project__slug"],
        "user": v["submitted_by__username"],
        "gpu_type": gpu_type,
        "state": v["state"],
        "created": v["created_at"].strftime("%Y-%m-%d %H:%M:%S"),
        "attempts": attempts,
        "gpu_hours": f"{gpu_seconds / 3600:.3f}",
        "preflight_cost": f"{preflight:.2f}",
        "running_cost": f"{running:.2f}",
        "cost": f"{preflight + running:.2f}",
        "wasted_cost": f"{(v['cost__wasted_cost'] or Decimal(0)):.2f}",
    }


def daily(user, f: CostFilter) -> QuerySet:
    """The roll-up rows the filter selects (state is a job's, not a day's: it does not apply here)."""
    return narrow(CostDaily.objects.filter(project__in=f.projects(user)), f, "user__username", "gpu_type", "day")


def rollup(user, f: CostFilter, by: str) -> list[dict]:
    """Spend grouped by project, user, GPU type, day or label, biggest (or, by day, latest) first."""
    key = ROLLUPS[by]
    rows = (
        daily(user, f)
        .values(key)
        .annotate(
            total=Sum("cost"),
            preflight=Sum("preflight_cost"),
            running=Sum("running_cost"),
            gpu_secs=Sum("gpu_seconds"),
            n=Sum("attempts"),
            wasted=Coalesce(Sum("cost", filter=Q(label__in=WASTED_LABELS)), ZERO),
        )
        .order_by(f"-{key}" if by == "day" else "-total", key)
    )
    return [
        {
            by: str(r[key]),
            "attempts": r["n"],
            "gpu_hours": f"{r['gpu_secs'] / 3600:.3f}",
            "preflight_cost": f"{r['preflight']:.2f}",
            "running_cost": f"{r['running']:.2f}",
            "cost": f"{r['total']:.2f}",
            "wasted_cost": f"{r['wasted']:.2f}",
        }
        for r in rows
    ]


def totals(user, f: CostFilter) -> dict:
    by_label = dict(daily(user, f).values_list("label").annotate(s=Sum("cost")).order_by())
    gpu_seconds = daily(user, f).aggregate(s=Sum("gpu_seconds"))["s"] or 0.0
    total = sum(by_label.values(), Decimal(0))
    return {
        "cost": f"{total:.2f}",
        "gpu_hours": f"{gpu_seconds / 3600:.1f}",
        "by_label": {k: f"{v:.2f}" for k, v in sorted(by_label.items())},
        "wasted_share": round(wasted_share(by_label), 4),
    }


def budgets(user, f: CostFilter) -> list:
    """This month's budget status of each visible project that has one."""
    today = timezone.now().date()
    found = []
    for project in f.projects(user).filter(budgets__isnull=False).distinct():
        budget = Budget.for_month(project.pk, today)
        if budget is not None:
            found.append(budget.status(today))
    return found


def figures(user, f: CostFilter) -> dict[str, str]:
    """The overview's Plotly figures, as JSON for plotly.js."""
    import plotly.graph_objects as go

    rows = daily(user, f)
    spend = go.Figure()
    per_project: dict[str, dict] = {}
    for day, slug, cost in rows.values_list("day", "project__slug").annotate(s=Sum("cost")).order_by("day"):
        per_project.setdefault(slug, {})[day.isoformat()] = float(cost)
    for slug, points in sorted(per_project.items()):
        spend.add_trace(go.Bar(x=list(points), y=list(points.values()), name=slug))
    spend.update_layout(barmode="stack", yaxis_title="spend", **LAYOUT)
    spend.update_xaxes(type="date", tickformat="%b %d")

    labels = dict(rows.values_list("label").annotate(s=Sum("cost")).order_by())
    share = go.Figure(go.Pie(labels=list(labels), values=[float(v) for v in labels.values()], hole=0.4))
    share.update_layout(**LAYOUT)

    hours = dict(rows.values_list("gpu_type").annotate(s=Sum("gpu_seconds")).order_by("gpu_type"))
    by_type = go.Figure(go.Bar(x=list(hours), y=[v / 3600 for v in hours.values()]))
    by_type.update_layout(yaxis_title="GPU-hours", **LAYOUT)
    return {name: fig.to_json() for name, fig in (("spend", spend), ("share", share), ("gpu_hours", by_type))}


LAYOUT = {"margin": {"l": 50, "r": 10, "t": 10, "b": 40}, "height": 300, "legend": {"orientation": "h"}}


def as_json(figs: dict[str, str]) -> dict:
    return {k: json.loads(v) for k, v in figs.items()}
