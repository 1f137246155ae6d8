"""Cost: the arithmetic, the roll-ups kept as attempts finish, budgets, pages, CSV and access."""

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.test import Client
from django.utils import timezone

from jobs import scheduler, settling
from jobs.costs import Rate, attempt_cost, interval_cost, label_for, wasted_share
from jobs.models import Attempt, Budget, CostDaily, FailureClass, GpuRate, JobCost, JobState
from tests.factories import api_client, make_attempt, make_job, make_node, make_project, make_user

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
H = timedelta(hours=1)


# --- pure arithmetic ------------------------------------------------------


def test_a_rate_change_mid_attempt_splits_it():
    rates = [Rate(T0, Decimal("2.00")), Rate(T0 + H, Decimal("4.00"))]
    # 2 GPUs: preflight 0:30-0:36 at 2.00, running 0:36-1:00 at 2.00 and 1:00-1:30 at 4.00.
    c = attempt_cost(2, T0 + H / 2, T0 + H / 2 + H / 10, T0 + H * 1.5, rates, now=T0 + 5 * H)
    assert c.preflight_seconds == 360 and c.running_seconds == 3240
    assert c.preflight_cost == Decimal("0.4000")  # 2 x 0.1 h x 2.00
    assert c.running_cost == Decimal("5.6000")  # 2 x 0.4 h x 2.00 + 2 x 0.5 h x 4.00
    assert c.cost == Decimal("6.0000")


def test_a_later_rate_never_changes_a_past_cost():
    before = interval_cost(1, T0, T0 + H, [Rate(T0, Decimal("3"))])
    after = interval_cost(1, T0, T0 + H, [Rate(T0, Decimal("3")), Rate(T0 + 2 * H, Decimal("100"))])
    assert before == after == Decimal("3.0000")


def test_time_before_any_rate_costs_nothing():
    assert interval_cost(1, T0 - H, T0 + H, [Rate(T0, Decimal("1"))]) == Decimal("1.0000")
    assert interval_cost(1, T0, T0 + H, []) == 0


def test_an_attempt_that_never_ran_its_command_is_all_preflight():
    c = attempt_cost(4, T0, None, T0 + H / 4, [Rate(T0, Decimal("1"))], now=T0 + H, state="failed")
    assert (c.preflight_seconds, c.running_seconds, c.preflight_cost, c.running_cost) == (900, 0, Decimal(1), 0)


def test_a_running_attempt_costs_so_far():
    c = attempt_cost(1, T0, T0, None, [Rate(T0, Decimal("1"))], now=T0 + 2 * H, state="running")
    assert c.cost == Decimal("2.0000") and c.label == "running"


def test_labels():
    assert label_for("failed", "preempted") == "preempted"
    assert label_for("lost", "infra") == "lost"
    assert label_for("failed", "user") == "failed"
    assert label_for("cancelled", "cancelled") == "cancelled"
    assert label_for("succeeded", "") == "succeeded"
    assert wasted_share({"succeeded": Decimal(3), "failed": Decimal(1)}) == 0.25


# --- recorded as attempts finish -----------------------------------------


@pytest.fixture
def rate(db):
    return GpuRate.objects.create(gpu_type="H100", effective_from=T0 - 1000 * H, per_gpu_hour=Decimal("2.50"))


def run_attempt(job, node, state, failure_class="", minutes=60, preflight_minutes=5, gpus=(0,), settled=True):
    """An attempt that ran for `minutes` (after `preflight_minutes` of preflight) and now ends,
    settled as the notifier settles it a moment later (unless not `settled`)."""
    now = timezone.now()
    attempt = make_attempt(
        job,
        node,
        "running",
        gpu_indices=list(gpus),
        started_at=now - timedelta(minutes=minutes + preflight_minutes),
        running_at=now - timedelta(minutes=minutes),
    )
    assert attempt.finish(state, failure_class, f"ended {state}")
    if settled:
        assert settling.settle(attempt.pk)
    attempt.refresh_from_db()
    return attempt


def approx(value) -> Decimal:
    return Decimal(value).quantize(Decimal("0.01"))


def test_a_finished_attempt_is_costed_with_preflight_apart(project, owner, node, rate):
    job = make_job(project, owner)
    run_attempt(job, node, "succeeded", gpus=(0, 1))
    jc = JobCost.objects.get(pk=job.pk)
    assert jc.attempts == 1 and jc.gpu_type == "H100"
    assert approx(jc.preflight_cost) == Decimal("0.42")  # 2 GPUs x 5 min x 2.50/h
    assert approx(jc.running_cost) == Decimal("5.00")
    assert jc.wasted_cost == 0
    (day,) = CostDaily.objects.all()
    assert day.label == "succeeded" and day.cost == jc.cost


def test_a_multi_attempt_job_sums_its_attempts_and_labels_the_wasted_ones(project, owner, node, rate):
    job = make_job(project, owner)
    lost = run_attempt(job, node, "lost", FailureClass.INFRA, minutes=30)
    job.refresh_from_db()
    assert job.state == JobState.QUEUED  # requeued after the infrastructure loss
    preempted = run_attempt(job, node, "failed", FailureClass.PREEMPTED, minutes=12)
    third = run_attempt(job, node, "succeeded", minutes=60)

    jc = JobCost.objects.get(pk=job.pk)
    from jobs.models import attempt_cost_of

    costs = [attempt_cost_of(a).cost for a in (lost, preempted, third)]
    assert jc.attempts == 3
    assert jc.cost == sum(costs)
    assert jc.wasted_cost == costs[0] + costs[1]
    labels = dict(CostDaily.objects.values_list("label", "cost"))
    assert set(labels) == {"lost", "preempted", "succeeded"}
    assert labels["lost"] == costs[0] and labels["preempted"] == costs[1]


def test_an_ended_attempt_is_priced_when_it_is_settled_and_only_once(project, owner, node, rate):
    job = make_job(project, owner)
    attempt = run_attempt(job, node, "succeeded", settled=False)
    assert attempt.priced_at is None  # its end freed the GPUs; its cost comes a moment later
    assert not JobCost.objects.filter(pk=job.pk).exists() and not CostDaily.objects.exists()
    assert settling.settle(attempt.pk)
    assert not settling.settle(attempt.pk)  # a second message (a redelivery, the reconciler): nothing added
    jc = JobCost.objects.get(pk=job.pk)
    attempt.refresh_from_db()
    assert jc.attempts == 1 and CostDaily.objects.get().attempts == 1 and attempt.priced_at is not None
    assert not settling.settle(make_attempt(make_job(project, owner), node, "running").pk)  # not ended: not priced


def test_a_jobs_attempts_settled_out_of_order_add_up(project, owner, node, rate):
    # The first attempt's settling still waits (or was lost) when the requeued second one's comes.
    job = make_job(project, owner)
    first = run_attempt(job, node, "lost", FailureClass.INFRA, minutes=30, settled=False)
    second = run_attempt(job, node, "succeeded", minutes=60)
    assert JobCost.objects.get(pk=job.pk).attempts == 1
    assert settling.settle(first.pk)
    from jobs.models import attempt_cost_of

    jc = JobCost.objects.get(pk=job.pk)
    assert jc.attempts == 2 and jc.cost == attempt_cost_of(first).cost + attempt_cost_of(second).cost
    assert jc.wasted_cost == attempt_cost_of(first).cost


def test_the_reconciler_settles_an_attempt_no_notifier_settled(project, owner, node, rate, settings):
    settings.HANGAR_SETTLE_OVERDUE_SECONDS = 60
    job = make_job(project, owner)
    attempt = run_attempt(job, node, "succeeded", settled=False)
    assert settling.settle_overdue() == []  # ended just now: the notifier's to settle
    later = timezone.now() + timedelta(seconds=61)
    assert settling.settle_overdue(now=later) == [attempt.pk]
    assert JobCost.objects.get(pk=job.pk).attempts == 1
    assert settling.settle_overdue(now=later) == []
    # The scheduler's periodic reconcile is what runs it.
    lost = run_attempt(make_job(project, owner, name="no notifier"), node, "failed", "user", settled=False)
    Attempt.objects.filter(pk=lost.pk).update(finished_at=timezone.now() - timedelta(seconds=61))
    scheduler.reconcile()
    assert JobCost.objects.get(pk=lost.job_id).attempts == 1


def test_an_attempt_that_cannot_be_settled_does_not_hold_back_the_others(project, owner, node, rate, monkeypatch):
    first = run_attempt(make_job(project, owner, name="first"), node, "succeeded", settled=False)
    second = run_attempt(make_job(project, owner, name="second"), node, "succeeded", settled=False)
    record = JobCost.record_attempt

    def fails_for_the_first(attempt_id):
        if attempt_id == first.pk:
            raise ValueError("a row this code cannot price")
        return record(attempt_id)

    monkeypatch.setattr(JobCost, "record_attempt", fails_for_the_first)
    assert settling.settle_due(older_than=0) == [second.pk]
    first.refresh_from_db()
    assert first.priced_at is None and not JobCost.objects.filter(pk=first.job_id).exists()  # tried again later
    monkeypatch.setattr(JobCost, "record_attempt", record)
    assert settling.settle_due(older_than=0) == [first.pk]


def test_a_writer_that_loses_the_race_to_create_a_days_row_adds_to_the_winners(project, owner, monkeypatch):
    """Two agents finishing the first attempts of a day at once: both find no row, one creates it,
    the other's insert collides and adds to it instead (nothing lost, no second row)."""
    from jobs.models import cost as costs

    day = timezone.now().date()
    key = {"day": day, "project_id": project.pk, "user_id": owner.pk, "gpu_type": "H100", "label": "succeeded"}
    added = {"attempts": 1, "gpu_seconds": 60.0, "preflight_cost": 0, "running_cost": Decimal("1.5"), "cost": 1}
    costs.add_to_row(CostDaily, key, added, {})  # the winner's row
    real_filter = CostDaily.objects.filter
    missed = []

    class RowNotYetThere:  # the loser's first UPDATE ran before the winner's INSERT
        def __init__(self, query):
            self.query = query

        def update(self, **fields):
            if not missed:
                missed.append(fields)
                return 0
            return self.query.update(**fields)

    monkeypatch.setattr(CostDaily.objects, "filter", lambda **kw: RowNotYetThere(real_filter(**kw)))
    costs.add_to_row(CostDaily, key, added, {})

    assert missed
    (row,) = CostDaily.objects.all()
    assert row.attempts == 2 and row.cost == 2 and row.running_cost == Decimal("3.0")


def test_rollups_equal_the_sum_of_job_costs(project, owner, teammate, outsider, rate):
    other = make_project("nlp", member=outsider)
    h100, a100 = make_node("n1"), make_node("n2", model="A100")
    GpuRate.objects.create(gpu_type="A100", effective_from=T0 - 1000 * H, per_gpu_hour=Decimal("1.10"))
    runs = [
        (project, owner, h100, "succeeded", ""),
        (project, teammate, a100, "failed", "user"),
        (project, teammate, h100, "failed", FailureClass.PREEMPTED),
        (other, outsider, a100, "succeeded", ""),
    ]
    for i, (proj, user, node, state, fc) in enumerate(runs):
        run_attempt(make_job(proj, user), node, state, fc, minutes=10 * (i + 1))

    admin = make_user("root", is_superuser=True)
    summary = api_client(admin).get("/api/v1/costs/summary/?by=project").json()
    by_project = {r["project"]: r["cost"] for r in summary["rows"]}
    for proj in (project, other):
        expected = JobCost.objects.filter(project=proj).aggregate(s=Sum("cost"))["s"]
        assert by_project[proj.slug] == f"{expected:.2f}"
    total = JobCost.objects.aggregate(s=Sum("cost"))["s"]
    assert summary["totals"]["cost"] == f"{total:.2f}"
    assert CostDaily.objects.aggregate(s=Sum("cost"))["s"] == total
    for by, key in (("user", "user__username"), ("gpu_type", "gpu_type")):
        rows = api_client(admin).get(f"/api/v1/costs/summary/?by={by}").json()["rows"]
        expected = JobCost.objects.values_list(key).annotate(s=Sum("cost"))
        assert {r[by]: r["cost"] for r in rows} == {k: f"{v:.2f}" for k, v in expected}, by
    for by in ("day", "label"):
        rows = api_client(admin).get(f"/api/v1/costs/summary/?by={by}").json()["rows"]
        assert abs(sum(Decimal(r["cost"]) for r in rows) - total) <= Decimal("0.005") * len(rows), by


# --- budgets --------------------------------------------------------------


def spend(project, user, amount: str):
    CostDaily.objects.create(
        day=timezone.now().date(), project=project, user=user, gpu_type="H100", label="succeeded", cost=Decimal(amount)
    )


def submit(user, project):
    return api_client(user).post("/api/v1/jobs/", {"project": project.slug, "command": ["true"]}, format="json")


def test_a_hard_budget_refuses_a_submission_saying_which_budget_and_what_is_left(project, owner, teammate, node):
    Budget.objects.create(project=project, amount=Decimal("100"), hard_limit=True)
    spend(project, owner, "100.50")
    response = submit(teammate, project)
    assert response.status_code == 400
    message = response.json()["errors"][0]["message"]
    month = timezone.now().strftime("%Y-%m")
    assert f"budget 'vision {month}' has 0.00 left of 100.00 (spent 100.50" in message
    assert "hard limit" in message


def test_a_soft_budget_warns_but_accepts(project, owner, teammate, node):
    Budget.objects.create(project=project, amount=Decimal("100"), warn_percent=50)
    spend(project, owner, "60")
    response = submit(teammate, project)
    assert response.status_code == 201
    (warning,) = response.json()["warnings"]  # an agent submitting through the API is told too
    assert warning.startswith("Budget warning: budget 'vision") and "40.00 left of 100.00" in warning
    client = Client()
    client.force_login(teammate)
    page = client.get("/costs/").content.decode()
    assert "Budget warning" in page and "40.00 left of 100.00" in page
    form = {"project": "vision", "command": "true", "gpus_per_node": 1, "priority": "normal"}
    form.update(max_runtime_seconds=60, gpu_type="", env="", name="")
    submitted = client.post("/jobs/new/", form, follow=True).content.decode()
    assert "submitted" in submitted and "Budget warning: budget &#x27;vision" in submitted


def test_a_budget_with_room_left_accepts(project, owner, teammate, node):
    Budget.objects.create(project=project, amount=Decimal("100"), hard_limit=True)
    spend(project, owner, "99")
    assert submit(teammate, project).status_code == 201


# --- pages, CSV, API and access --------------------------------------------


@pytest.fixture
def costed_jobs(project, owner, teammate, node, rate):
    jobs = []
    for i in range(7):
        job = make_job(project, owner if i % 2 else teammate, name=f"run-{i}")
        run_attempt(job, node, "succeeded" if i % 3 else "failed", "" if i % 3 else "user", minutes=5 + i)
        jobs.append(job)
    return jobs


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_the_csv_export_equals_the_table(owner, costed_jobs):
    client = logged_in(owner)
    page = client.get("/costs/jobs/?sort=-cost")
    assert page.status_code == 200
    shown = [[str(cell) for cell in row] for row in page.context["rows"]]
    assert len(shown) == 7
    body = b"".join(client.get("/costs/jobs.csv?sort=-cost").streaming_content).decode()
    header, *rows = list(csv.reader(io.StringIO(body)))
    assert header == page.context["columns"]
    assert rows == shown
    costs = [Decimal(r[header.index("cost")]) for r in rows]
    assert costs == sorted(costs, reverse=True)


def test_filters_narrow_the_table(owner, teammate, costed_jobs):
    rows = logged_in(owner).get("/costs/jobs/?user=teammate&state=failed").context["rows"]
    assert rows and all(r[3] == "teammate" and r[5] == "failed" for r in rows)
    api = api_client(owner).get("/api/v1/costs/jobs/?user=teammate&limit=2").json()
    assert api["count"] == 4 and len(api["results"]) == 2


def test_the_overview_page_has_its_charts(owner, costed_jobs):
    page = logged_in(owner).get("/costs/").content.decode()
    for name in ("fig-spend", "fig-share", "fig-hours"):
        assert f'id="{name}"' in page
    assert "plotly.min.js" in page


def test_a_running_job_shows_its_cost_so_far(project, owner, node, rate):
    job = make_job(project, owner)
    make_attempt(job, node, "running", started_at=timezone.now() - H, running_at=timezone.now() - H)
    (row,) = api_client(owner).get("/api/v1/costs/jobs/").json()["results"]
    assert row["state"] == "running" and Decimal(row["cost"]) == approx("2.50")


def test_running_jobs_are_costed_with_a_fixed_number_of_queries(
    project, owner, node, rate, django_assert_max_num_queries
):
    from jobs import costreports

    for _ in range(6):
        make_attempt(
            make_job(project, owner), node, "running", started_at=timezone.now() - H, running_at=timezone.now() - H
        )
    table = costreports.job_table(owner, costreports.CostFilter.from_params({}))

    with django_assert_max_num_queries(4):  # the jobs, their live attempts, the H100 rates
        rows = list(costreports.job_rows(table))

    assert len(rows) == 6 and all(Decimal(r["cost"]) == approx("2.50") for r in rows)


def test_a_member_cannot_see_another_projects_costs(outsider, other_project, costed_jobs):
    client = logged_in(outsider)
    assert client.get("/costs/?project=vision").status_code == 404
    assert client.get("/costs/jobs/?project=vision").status_code == 404
    assert client.get("/costs/rollup.csv?project=vision").status_code == 404
    assert b"run-" not in b"".join(client.get("/costs/jobs.csv").streaming_content)
    assert client.get("/costs/jobs/").context["rows"] == []
    api = api_client(outsider)
    assert api.get("/api/v1/costs/summary/?project=vision").status_code == 404
    assert api.get("/api/v1/costs/jobs/").json()["count"] == 0
    assert api.get("/api/v1/costs/summary/").json()["totals"]["cost"] == "0.00"


def test_a_viewer_does_not_see_costs(project, costed_jobs):
    viewer = make_user("viewer")
    project.memberships.create(user=viewer, role="viewer")
    assert logged_in(viewer).get("/costs/?project=vision").status_code == 404


def test_anonymous_is_refused(costed_jobs):
    assert Client().get("/costs/").status_code == 302
    assert api_client().get("/api/v1/costs/summary/").status_code in (401, 403)
