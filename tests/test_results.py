"""The result contract: `objective` and `metrics_from_log` at submit, metrics read from log
lines, and `GET /api/v1/jobs/<id>/result/` and `/compare/` (README: Agents)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import results
from jobs.logmetrics import LogMetrics, compile_pattern
from jobs.models import Attempt, Job, LogLine, Severity, Stream
from portal.patterns import PatternError
from tests.factories import api_client, make_attempt, make_job
from tests.test_submit_validation import assert_refused

PATTERN = r"(?P<name>val_loss|acc): (?P<value>[-+0-9.eE]+)"


# --- plain functions ---------------------------------------------------------------------


def test_log_metrics_count_steps_per_name_and_skip_lines_that_do_not_match():
    found = LogMetrics(PATTERN)
    for text in ["epoch 1", "val_loss: 0.9", "acc: 0.5", "val_loss: 0.7", "val_loss: nope", "val_loss: inf"]:
        found.scan(text)
    points = [(p.name, p.value, p.step) for p in found.take()]
    assert points == [("val_loss", 0.9, 0), ("acc", 0.5, 0), ("val_loss", 0.7, 1)]
    assert found.take() == []


def test_a_step_group_gives_the_step():
    found = LogMetrics(r"step (?P<step>\d+) (?P<name>loss)=(?P<value>\S+)")
    found.scan("step 40 loss=0.25")
    assert [(p.step, p.value) for p in found.take()] == [(40, 0.25)]


def test_names_and_points_are_bounded(monkeypatch):
    monkeypatch.setattr("jobs.logmetrics.MAX_NAMES", 2)
    monkeypatch.setattr("jobs.logmetrics.MAX_POINTS", 3)
    found = LogMetrics(r"(?P<name>\w+)=(?P<value>\S+)")
    for text in ["a=1", "b=2", "c=3", "a=4", "b=5", "a=6"]:
        found.scan(text)
    assert [(p.name, p.value) for p in found.take()] == [("a", 1.0), ("b", 2.0), ("a", 4.0)]


def test_a_pattern_without_both_named_groups_is_refused_naming_the_field():
    with pytest.raises(PatternError) as refused:
        compile_pattern(r"val_loss: (?P<value>\d+)")
    assert refused.value.field == "metrics_from_log" and "(?P<name>...)" in refused.value.message
    with pytest.raises(PatternError):
        compile_pattern(r"(?P<name>a)(?P<value>\1)")  # a backreference: not RE2


def test_summaries_give_last_and_best_by_the_objective_and_by_name():
    series = {"val_loss": [[0, 0.9, 1], [1, 0.4, 2], [2, 0.6, 3]], "accuracy": [[0, 0.2, 1], [1, 0.8, 2]]}
    summary = results.summarise(series, {"metric": "val_loss", "mode": "min"})
    assert summary["val_loss"]["last"] == {"value": 0.6, "step": 2}
    assert summary["val_loss"]["best"] == {"value": 0.4, "step": 1}
    assert summary["accuracy"]["best"] == {"value": 0.8, "step": 1} and summary["accuracy"]["best_mode"] == "max"
    objective = results.objective_value({"metric": "val_loss", "mode": "min"}, summary)
    assert objective["value"] == 0.6 and objective["best"] == 0.4 and objective["found"]
    missing = results.objective_value({"metric": "val_bpb", "mode": "min"}, summary)
    assert missing["value"] is None and not missing["found"]
    assert results.objective_value({}, summary) is None


def test_better_of_follows_the_mode():
    low = {"metric": "loss", "mode": "min", "value": 0.1}
    high = {"metric": "loss", "mode": "min", "value": 0.3}
    assert results.better_of(1, low, 2, high) == 1
    assert results.better_of(1, {**low, "mode": "max"}, 2, {**high, "mode": "max"}) == 2
    assert results.better_of(1, low, 2, {**high, "metric": "acc"}) is None


# --- submit ---------------------------------------------------------------------------------


@pytest.fixture
def client(owner, project, node):
    return api_client(owner)


def test_objective_and_pattern_are_stored_and_shown(client):
    body = {"project": "vision", "command": ["true"], "objective": {"metric": "val_loss", "mode": "min"}}
    response = client.post("/api/v1/jobs/", {**body, "metrics_from_log": PATTERN}, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.objective == {"metric": "val_loss", "mode": "min"} and job.metrics_from_log == PATTERN
    assert response.json()["objective"] == job.objective and response.json()["urls"]["result"].endswith("/result/")


@pytest.mark.parametrize(
    "fields, field, fragment",
    [
        ({"metrics_from_log": r"val_loss: (?P<value>\S+)"}, "metrics_from_log", "(?P<name>...)"),
        ({"metrics_from_log": r"(?P<name>x)(?P<value>(a+)+\1)"}, "metrics_from_log", "RE2"),
        ({"objective": {"metric": "val_loss"}}, "objective.mode", "min"),
        ({"objective": {"metric": "val_loss", "mode": "lowest"}}, "objective.mode", "use min"),
        ({"objective": {"metric": "val_loss", "mode": "min", "goal": 1}}, "objective.goal", "metric and mode"),
        ({"objective": "val_loss"}, "objective", ""),
    ],
)
def test_bad_result_fields_are_refused_naming_the_field(client, fields, field, fragment):
    response = client.post("/api/v1/jobs/", {"project": "vision", "command": ["true"], **fields}, format="json")
    assert_refused(response, field, fragment)


# --- the result document ----------------------------------------------------------------------


@pytest.fixture
def crashed(owner, project, node, settings):
    settings.HANGAR_MLFLOW = False
    job = make_job(project, owner, objective={"metric": "val_loss", "mode": "min"})
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(queued_at=now - timedelta(seconds=30))
    job.refresh_from_db()
    attempt = make_attempt(
        job, node, "failed", started_at=now - timedelta(seconds=20), running_at=now - timedelta(seconds=18),
        finished_at=now, exit_code=1, failure_class="user",
        diagnosis={"category": "python_exception", "summary": "ValueError: bad", "hint": "fix it",
                   "confidence": "high", "first_failing_rank": 0, "evidence": []},
    )  # fmt: skip
    Job.objects.filter(pk=job.pk).update(exit_code=1, failure_class="user", finished_at=now)
    lines = [f"line {i}" for i in range(70)] + ["Traceback (most recent call last):", "ValueError: bad"]
    LogLine.objects.bulk_create(
        LogLine(job=job, attempt=attempt, node=node, seq=i + 1, rank_seq=i + 1, stream=Stream.STDOUT, ts=now,
                text=text, severity=Severity.ERROR if text.startswith(("Trace", "Value")) else Severity.INFO)
        for i, text in enumerate(lines)
    )  # fmt: skip
    return job


def test_a_crashed_job_has_its_diagnosis_tail_first_error_and_times(client, crashed):
    body = client.get(f"/api/v1/jobs/{crashed.pk}/result/").json()
    assert body["state"] == "failed" and body["exit_code"] == 1 and body["failure_class"] == "user"
    assert body["diagnosis"]["category"] == "python_exception"
    assert len(body["log_tail"]) == 50 and body["log_tail"][-1]["text"] == "ValueError: bad"
    assert body["first_error"]["text"] == "Traceback (most recent call last):"
    assert body["objective"] == {"metric": "val_loss", "mode": "min"} | {
        "value": None, "step": None, "best": None, "best_step": None, "found": False
    }  # fmt: skip
    assert not body["metrics_available"] and "HANGAR_MLFLOW" in body["metrics_reason"]
    times = body["times"]
    assert 9 < times["queued_seconds"] < 11 and 1.9 < times["preflight_seconds"] < 2.1
    assert 17.9 < times["running_seconds"] < 18.1
    assert set(body["cost"]) == {"total", "preflight", "wasted", "gpu_hours"}
    assert body["cost"]["gpu_hours"] == pytest.approx(20 / 3600, abs=1e-3)


def test_another_projects_result_and_comparison_answer_404(crashed, outsider, other_project):
    client = api_client(outsider)
    assert client.get(f"/api/v1/jobs/{crashed.pk}/result/").status_code == 404
    mine = make_job(other_project, outsider)
    assert client.get(f"/api/v1/jobs/compare/?a={mine.pk}&b={crashed.pk}").status_code == 404


def test_compare_names_the_spec_differences(client, crashed, owner, project):
    other = make_job(project, owner, command=["python", "train.py", "--lr", "0.1"])
    body = client.get(f"/api/v1/jobs/compare/?a={crashed.pk}&b={other.pk}").json()
    fields = {row["field"] for row in body["spec_differences"]}
    assert "command" in fields and "objective" in fields and "env" not in fields
    assert body["outcome"]["state"] == {"a": "failed", "b": "queued"}
    missing = client.get(f"/api/v1/jobs/compare/?a={crashed.pk}")
    assert missing.status_code == 400 and missing.json()["errors"][0]["field"] == "b"


def test_a_queued_job_counts_its_wait_so_far(client, owner, project, settings):
    settings.HANGAR_MLFLOW = False
    job = make_job(project, owner, queued_at=timezone.now() - timedelta(seconds=5))
    body = client.get(f"/api/v1/jobs/{job.pk}/result/").json()
    assert body["state"] == "queued" and body["log_tail"] == [] and body["first_error"] is None
    assert body["times"]["queued_seconds"] >= 5 and body["attempt_count"] == 0
    assert not Attempt.objects.exists()


def test_a_resubmit_keeps_the_objective_and_the_pattern(client, owner, project):
    body = {"project": "vision", "command": ["true"], "objective": {"metric": "acc", "mode": "max"}}
    job_id = client.post("/api/v1/jobs/", {**body, "metrics_from_log": PATTERN}, format="json").json()["id"]
    again = client.post(f"/api/v1/jobs/{job_id}/resubmit/", {}, format="json")
    assert again.status_code == 201, again.content
    assert again.json()["objective"] == {"metric": "acc", "mode": "max"} and again.json()["metrics_from_log"] == PATTERN
