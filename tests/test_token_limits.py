"""Limits of an API token (jobs/tokenlimits.py): each refuses a submit over it with the limit,
what is used and when it frees (429 + Retry-After, or 403 for spend), and creates nothing."""

import re
from datetime import timedelta
from decimal import Decimal
from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from jobs import tokenlimits
from jobs.models import GpuRate, Job, JobEvent
from portal.models import ApiToken
from tests.factories import make_attempt, make_job

URL = "/api/v1/jobs/"


@pytest.fixture
def limited(owner, project, node):
    """issue(**limits) -> (token, client authenticated by it)."""

    def issue(**limits):
        token, raw = ApiToken.issue(owner, "agent", **limits)
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
        return token, client

    return issue


def submit(client, gpus: int = 1, **fields):
    body = {"project": "vision", "command": ["true"], "gpus_per_node": gpus, **fields}
    return client.post(URL, body, format="json")


def refused(response, status: int, field: str, *fragments: str, jobs: int) -> str:
    assert response.status_code == status, response.content
    body = response.json()
    assert body["code"] == "token_limit" and body["errors"][0]["field"] == field, body
    for fragment in fragments:
        assert fragment in body["message"], body["message"]
    assert Job.objects.count() == jobs and JobEvent.objects.filter(kind="submitted").count() <= jobs
    return body["message"]


def test_max_running_jobs_refuses_with_retry_after_until_one_ends(limited, owner):
    token, client = limited(max_running_jobs=1)
    first = submit(client)
    assert first.status_code == 201 and Job.objects.get().submitted_with == token
    response = submit(client)
    refused(response, 429, "token.max_running_jobs", "1 unfinished jobs", "max_running_jobs=1", jobs=1)
    assert int(response["Retry-After"]) == tokenlimits.NO_ESTIMATE_RETRY_SECONDS  # queued: no end to estimate
    Job.objects.get().cancel(owner, "done with it")
    assert submit(client).status_code == 201


def test_retry_after_is_when_the_soonest_running_job_must_end(limited, node):
    token, client = limited(max_running_jobs=1)
    job = Job.objects.get(pk=submit(client, max_runtime_seconds=3600).json()["id"])
    make_attempt(job, node, "running", started_at=timezone.now() - timedelta(seconds=3500))  # max runtime 3600
    response = submit(client)
    refused(response, 429, "token.max_running_jobs", "at the latest by", jobs=1)
    assert 90 <= int(response["Retry-After"]) <= 101


def test_max_gpus_counts_the_gpus_of_unfinished_jobs(limited):
    _, client = limited(max_gpus=3)
    assert submit(client, gpus=2).status_code == 201
    response = submit(client, gpus=2)
    refused(response, 429, "token.max_gpus", "hold 2 GPUs", "asks for 2", "max_gpus=3", jobs=1)
    assert response["Retry-After"]
    too_big = submit(client, gpus=4)
    assert too_big.status_code == 400 and too_big.json()["errors"][0]["field"] == "gpus_per_node"
    assert "at most 3" in too_big.json()["message"] and Job.objects.count() == 1
    assert submit(client, gpus=1).status_code == 201


def test_only_a_token_with_limits_is_locked_by_its_submits(limited, monkeypatch):
    """An unlimited token's submits do not take turns on its row (an agent submitting in
    parallel with one token waited for each of its own submits); a limited one's do."""
    from django.db.models import QuerySet

    locked = []
    select_for_update = QuerySet.select_for_update

    def spy(queryset, *args, **kwargs):
        locked.append(queryset.model)
        return select_for_update(queryset, *args, **kwargs)

    monkeypatch.setattr(QuerySet, "select_for_update", spy)
    _, free = limited()
    assert submit(free).status_code == 201 and ApiToken not in locked
    _, capped = limited(max_running_jobs=5)
    assert submit(capped).status_code == 201 and ApiToken in locked


def used_today(token, owner, project, node, hours: float, gpus: int = 1):
    """A finished attempt of the token's, `hours` long, ending now."""
    job = make_job(project, owner, submitted_with=token, gpus_per_node=gpus)
    now = timezone.now()
    start = max(now - timedelta(hours=hours), tokenlimits.day_bounds(now)[0])
    make_attempt(job, node, "succeeded", gpu_indices=list(range(gpus)), started_at=start, running_at=start,
                 finished_at=now)  # fmt: skip
    return now - start


def test_max_gpu_hours_per_day_refuses_until_midnight(limited, owner, project, node):
    token, client = limited(max_gpu_hours_per_day=Decimal("0.01"))
    used_today(token, owner, project, node, hours=0.5)
    response = submit(client)
    refused(response, 429, "token.max_gpu_hours_per_day", "GPU-hours today", "frees at 00:00 UTC", jobs=1)
    seconds_left = (tokenlimits.day_bounds(timezone.now())[1] - timezone.now()).total_seconds()
    assert abs(int(response["Retry-After"]) - seconds_left) < 5


def test_yesterdays_attempts_do_not_count_today(owner, project, node):
    token, _ = ApiToken.issue(owner, "agent", max_gpu_hours_per_day=Decimal("1"))
    midnight = tokenlimits.day_bounds(timezone.now())[0]
    job = make_job(project, owner, submitted_with=token)
    start = midnight - timedelta(hours=5)
    make_attempt(job, node, "succeeded", started_at=start, running_at=start, finished_at=midnight - timedelta(hours=1))
    assert tokenlimits.usage(token).gpu_hours_today == 0


def test_max_spend_per_day_is_a_403(limited, owner, project, node):
    GpuRate.objects.create(gpu_type="H100", effective_from=timezone.now() - timedelta(days=1), per_gpu_hour=100)
    token, client = limited(max_spend_per_day=Decimal("0.50"))
    held = used_today(token, owner, project, node, hours=0.25)
    message = refused(submit(client), 403, "token.max_spend_per_day", "max_spend_per_day=0.50", jobs=1)
    spent = float(re.search(r"spent (\d+\.\d\d) today", message).group(1))
    assert spent == pytest.approx(100 * held.total_seconds() / 3600, abs=0.05)
    assert tokenlimits.usage(token).spend_today > Decimal("0.50")


def test_jobs_of_other_tokens_and_of_the_browser_do_not_count(limited, owner, project):
    _, client = limited(max_running_jobs=1)
    other, _ = ApiToken.issue(owner, "other")
    make_job(project, owner, submitted_with=other)
    make_job(project, owner)
    assert submit(client).status_code == 201


def test_limits_show_in_the_api_and_a_limited_token_mints_no_wider_one(limited):
    token, client = limited(max_running_jobs=2, max_spend_per_day=Decimal("10"))
    listed = client.get(f"/api/v1/tokens/{token.pk}/").json()
    assert listed["max_running_jobs"] == 2 and listed["max_spend_per_day"] == "10.00" and listed["max_gpus"] is None
    submit(client)
    usage = client.get("/api/v1/tokens/current/usage/").json()
    assert usage["limits"]["max_running_jobs"] == "2" and usage["used"]["running_jobs"] == 1
    wider = client.post("/api/v1/tokens/", {"name": "escape"}, format="json")
    assert wider.status_code == 400 and wider.json()["errors"][0]["field"] == "max_running_jobs"
    narrower = client.post(
        "/api/v1/tokens/", {"name": "child", "max_running_jobs": 1, "max_spend_per_day": "5"}, format="json"
    )
    assert narrower.status_code == 201 and ApiToken.objects.get(name="child").max_running_jobs == 1


def test_another_users_token_usage_answers_404(limited, outsider):
    token, _ = limited(max_gpus=1)
    _, raw = ApiToken.issue(outsider, "mine")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert client.get(f"/api/v1/tokens/{token.pk}/usage/").status_code == 404


def test_the_tokens_page_and_create_token_set_and_show_limits(owner, project):
    out = StringIO()
    call_command(
        "create_token", "owner", "--name", "cli-agent", "--max-gpus", "4", "--max-spend-per-day", "20", stdout=out
    )
    made = ApiToken.objects.get(name="cli-agent")
    assert made.max_gpus == 4 and made.max_spend_per_day == Decimal("20") and out.getvalue().startswith("hgr_")
    page = Client()
    page.force_login(owner)
    response = page.post("/tokens/", {"name": "sweeper", "max_running_jobs": "3"})
    assert response.status_code == 200 and ApiToken.objects.get(name="sweeper").max_running_jobs == 3
    html = page.get("/tokens/").content.decode()
    assert "jobs 0 / 3" in html and "GPUs 0 / 4" in html
