"""Sweeps (jobs/sweeps.py): variants of a base job, each a job with its own idempotency key,
submitted as max_parallel allows, ranked by the objective; bad input creates nothing."""

import pytest
from django.test import Client
from rest_framework.test import APIClient

from jobs import sweeps, tracking
from jobs.models import AttemptState, Job, Sweep
from portal.models import ApiToken
from tests.factories import api_client, make_attempt
from tests.test_tracking import mlflow_store  # noqa: F401 (a fixture)

URL = "/api/v1/sweeps/"
OBJECTIVE = {"metric": "val_loss", "mode": "min"}


def sweep_body(**fields) -> dict:
    return {
        "name": "lr",
        "project": "vision",
        "max_parallel": 2,
        "objective": OBJECTIVE,
        "base": {"command": ["python", "train.py"], "env": {"EPOCHS": "3"}},
        "grid": {"env.LR": ["0.1", "0.01"], "gpus_per_node": [1, 2]},
        **fields,
    }


# --- plain functions ---------------------------------------------------------------------


def test_a_grid_expands_to_its_product_in_order():
    params = sweeps.expand({"grid": {"a": [1, 2], "b": ["x", "y"]}})
    assert params == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]


def test_overrides_set_one_variable_or_replace_a_field():
    base = {"command": ["python"], "env": {"A": "1"}}
    spec = sweeps.apply(base, {"env.B": "2", "gpus_per_node": 2, "config": {"lr": 1}})
    assert spec == {"command": ["python"], "env": {"A": "1", "B": "2"}, "gpus_per_node": 2, "config": {"lr": 1}}
    assert base["env"] == {"A": "1"}  # the base is not changed


def test_rank_puts_the_best_first_and_runs_without_a_value_last():
    runs = [{"index": 0, "objective": 0.5}, {"index": 1, "objective": None}, {"index": 2, "objective": 0.2}]
    assert [r["index"] for r in sweeps.rank(runs, "min")] == [2, 0, 1]
    assert [r["index"] for r in sweeps.rank(runs, "max")] == [0, 2, 1]


def test_the_key_is_the_content_unless_one_is_given():
    assert sweeps.file_key({"a": 1, "b": 2}) == sweeps.file_key({"b": 2, "a": 1})
    assert sweeps.file_key({"a": 1}) != sweeps.file_key({"a": 2})
    assert sweeps.file_key({"a": 1, "idempotency_key": "mine"}) == "mine"


# --- the API --------------------------------------------------------------------------------


@pytest.fixture
def client(owner, project, node, settings):
    settings.HANGAR_MLFLOW = False
    return api_client(owner)


def test_a_sweep_submits_max_parallel_variants_and_the_same_file_creates_nothing_twice(client):
    response = client.post(URL, sweep_body(), format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["variants"] == 4 and body["counts"] == {"queued": 2, "pending": 2} and body["state"] == "running"
    jobs = list(Job.objects.order_by("sweep_index"))
    assert [j.sweep_index for j in jobs] == [0, 1]
    assert [j.idempotency_key for j in jobs] == [f"sweep-{body['id']}-0", f"sweep-{body['id']}-1"]
    assert jobs[0].env == {"EPOCHS": "3", "LR": "0.1"} and jobs[1].gpus_per_node == 2
    assert jobs[0].objective == OBJECTIVE and jobs[0].name == "lr-0"

    again = client.post(URL, sweep_body(), format="json")
    assert again.status_code == 200 and again["Idempotent-Replayed"] == "true" and again.json()["id"] == body["id"]
    assert Sweep.objects.count() == 1 and Job.objects.count() == 2


def test_a_job_that_ends_lets_the_next_variant_in(client, node, django_capture_on_commit_callbacks):
    sweep_id = client.post(URL, sweep_body(), format="json").json()["id"]
    first = Job.objects.get(sweep_index=0)
    attempt = make_attempt(first, node, AttemptState.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        attempt.finish(AttemptState.SUCCEEDED, exit_code=0)
    assert sorted(Job.objects.values_list("sweep_index", flat=True)) == [0, 1, 2]
    with django_capture_on_commit_callbacks(execute=True):
        Job.objects.get(sweep_index=1).cancel(None, "not this one")
    doc = client.get(f"{URL}{sweep_id}/").json()
    assert doc["counts"] == {"succeeded": 1, "cancelled": 1, "queued": 2} and doc["best"] is None


@pytest.mark.parametrize(
    "fields, field, fragment",
    [
        ({"gird": {"a": [1]}}, "gird", "not a sweep field"),
        ({"grid": {}}, "grid", "is empty"),
        ({"grid": {"env.LR": []}}, "grid.env.LR", "non-empty list"),
        ({"grid": None, "variants": []}, "variants", "is empty"),
        ({"grid": None}, "grid", "either grid"),
        ({"grid": None, "variants": [{"gpus_per_node": 1}, {"gpus_per_node": 0}]}, "variants[1].gpus_per_node", ""),
        ({"grid": None, "variants": [{"colour": "red"}]}, "variants[0].colour", "not a job field"),
        ({"objective": None}, "objective", "is required"),
        ({"objective": {"metric": "loss", "mode": "low"}}, "objective.mode", "use min"),
        ({"max_parallel": "four"}, "max_parallel", "whole number"),
        ({"project": "nlp"}, "project", "your projects: vision"),
        ({"base": {"name": "no command"}}, "base", "command"),
    ],
)
def test_bad_sweep_files_are_refused_naming_the_field_and_create_nothing(client, fields, field, fragment):
    response = client.post(URL, sweep_body(**fields), format="json")
    assert response.status_code == 400, response.content
    errors = {e["field"]: e["message"] for e in response.json()["errors"]}
    assert field in errors and fragment in errors[field], errors
    assert not Sweep.objects.exists() and not Job.objects.exists()


def test_a_token_cap_lets_some_variants_run_and_the_rest_wait(owner, project, node, settings):
    settings.HANGAR_MLFLOW = False
    _, raw = ApiToken.issue(owner, "agent", max_running_jobs=1)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    body = client.post(URL, sweep_body(max_parallel=3), format="json").json()
    assert Job.objects.count() == 1 and "max_running_jobs=1" in body["waiting_reason"]
    assert Job.objects.get().submitted_with.name == "agent"


def test_another_projects_sweep_answers_404(client, outsider, other_project):
    sweep_id = client.post(URL, sweep_body(), format="json").json()["id"]
    theirs = api_client(outsider)
    assert theirs.get(f"{URL}{sweep_id}/").status_code == 404
    assert theirs.get(URL).json()["count"] == 0
    page = Client()
    page.force_login(outsider)
    assert page.get(f"/jobs/sweeps/{sweep_id}/").status_code == 404


def test_the_sweep_page_lists_runs_with_params_and_sorts(client, owner):
    sweep_id = client.post(URL, sweep_body(), format="json").json()["id"]
    page = Client()
    page.force_login(owner)
    html = page.get(f"/jobs/sweeps/{sweep_id}/?sort=index").content.decode()
    assert "env.LR" in html and "gpus_per_node" in html and "0.01" in html and "pending" in html
    assert f"/jobs/sweeps/{sweep_id}/" in page.get("/jobs/sweeps/").content.decode()


def test_the_charts_show_the_objective_per_run_and_parameters(client):
    sweep = Sweep.objects.get(pk=client.post(URL, sweep_body(), format="json").json()["id"])
    runs = [{"index": i, "params": p, "objective": 1.0 / (i + 1)} for i, p in enumerate(sweep.params)]
    figures = sweeps.figures(sweep, runs)
    assert figures["per_run"]["data"][0]["y"] == [1.0, 0.5, 1 / 3, 0.25]
    dims = {d["label"]: d for d in figures["parallel"]["data"][0]["dimensions"]}
    assert list(dims) == ["env.LR", "gpus_per_node", "val_loss"] and dims["gpus_per_node"]["values"] == [1, 2, 1, 2]


def test_cancelling_a_sweep_stops_its_variants(client, teammate, django_capture_on_commit_callbacks):
    sweep_id = client.post(URL, sweep_body(), format="json").json()["id"]
    refused = api_client(teammate).post(f"{URL}{sweep_id}/cancel/", {}, format="json")
    assert refused.status_code == 403 and "submitter or a manager" in refused.json()["message"]
    with django_capture_on_commit_callbacks(execute=True):
        body = client.post(f"{URL}{sweep_id}/cancel/", {"reason": "enough"}, format="json").json()
    assert body["cancelled_jobs"] == 2 and body["state"] == "done"
    assert body["counts"] == {"cancelled": 2, "refused": 2} and Job.objects.count() == 2
    assert all(run.get("reason") == "cancelled: enough" for run in body["runs"] if run["state"] == "refused")


def test_the_same_key_with_another_file_is_a_conflict(client):
    first = client.post(URL, sweep_body(idempotency_key="round-1"), format="json")
    assert first.status_code == 201
    other = client.post(URL, sweep_body(idempotency_key="round-1", max_parallel=1), format="json")
    assert other.status_code == 409 and "use a new key" in other.json()["message"]
    assert Sweep.objects.count() == 1 and Job.objects.count() == 2


@pytest.mark.usefixtures("mlflow_store")
def test_runs_are_ranked_by_their_mlflow_objective_on_the_api_and_the_page(client, owner, settings):
    settings.HANGAR_MLFLOW = True  # (the client fixture turned it off)
    sweep_id = client.post(URL, sweep_body(max_parallel=4), format="json").json()["id"]
    experiment = tracking.experiment_id("vision")
    for job in Job.objects.filter(sweep_id=sweep_id):
        run = tracking.client().create_run(experiment)
        for step, loss in enumerate([1.0, 0.3 + job.sweep_index / 10]):  # the last value ranks
            tracking.client().log_metric(run.info.run_id, "val_loss", loss, step=step)
        Job.objects.filter(pk=job.pk).update(mlflow_run_id=run.info.run_id, mlflow_experiment_id=experiment)
    body = client.get(f"{URL}{sweep_id}/").json()
    assert [r["index"] for r in body["runs"]] == [0, 1, 2, 3]
    assert body["best"]["objective"] == pytest.approx(0.3) and body["best"]["params"] == {
        "env.LR": "0.1",
        "gpus_per_node": 1,
    }
    page = Client()
    page.force_login(owner)
    html = page.get(f"/jobs/sweeps/{sweep_id}/?sort=-objective").content.decode()
    assert 'data-figure="fig-parallel"' in html and 'data-figure="fig-per-run"' in html
    table = html[html.index("<h2>Runs</h2>") :]
    assert table.index("0.6") < table.index("0.3")  # worst first
