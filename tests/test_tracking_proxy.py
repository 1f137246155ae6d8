"""Hangar's MLflow tracking proxy: a job's credential reaches its own run and experiment only,
and stops working when its attempt ends. The requests here are what MLflow's client sends (its
own messages, made by its own serializer); tests/test_e2e_tracking.py runs the real client
in real job processes."""

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from jobs import tracking, trackingproxy
from jobs.trackingproxy import ACKNOWLEDGE, ENDPOINTS, SERVE, Asked, Grant, Refusal, decide
from portal.models import ApiToken, hash_token
from tests.factories import make_attempt, make_job

PREFIX = "/api/mlflow/api/2.0/mlflow/"


@pytest.fixture
def mlflow_store(settings, tmp_path):
    settings.MLFLOW_TRACKING_URI = f"sqlite:///{tmp_path}/mlflow.db"
    settings.DATA_DIR = tmp_path
    settings.HANGAR_MLFLOW = True
    tracking._client = None
    yield settings.MLFLOW_TRACKING_URI
    tracking._client = None


def started(job, node) -> dict:
    """What the runner gives an attempt's processes: its MLFLOW_* variables."""
    attempt = make_attempt(job, node, "running", started_at=timezone.now())
    attempt = type(attempt).objects.select_related("job__project", "node").get(pk=attempt.pk)
    env = tracking.job_env(attempt.job, attempt)
    job.refresh_from_db()
    return env


def call(env: dict, name: str, message=None, method: str = "POST", **query) -> tuple[int, dict]:
    """One request as MLflow's REST client makes it: the message as JSON, or the query of a GET."""
    from mlflow.utils.proto_json_utils import message_to_json

    headers = {"HTTP_AUTHORIZATION": f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"} if env else {}
    if method == "GET":
        response = Client().get(PREFIX + name, query, **headers)
    else:
        body = message_to_json(message) if message is not None else "{}"
        response = Client().generic(method, PREFIX + name, body, content_type="application/json", **headers)
    return response.status_code, json.loads(response.content or b"{}")


def protos():
    from mlflow.protos import service_pb2

    return service_pb2


@pytest.fixture
def two_jobs(mlflow_store, project, owner, node):
    """Two running jobs of one project (one experiment), each with its credential."""
    mine, other = make_job(project, owner, name="mine"), make_job(project, owner, name="other")
    return (mine, started(mine, node)), (other, started(other, node))


# --- the decision, over plain data ------------------------------------------------------

GRANT = Grant(attempt_id=7, number=1, job_id=3, run_id="r-own", experiment_id="1", live=True, ended_at=None)
GRACE = timedelta(seconds=30)
NOW = timezone.now()


def test_it_serves_a_live_attempts_own_run_and_experiment():
    assert decide(GRANT, ENDPOINTS["runs/log-metric"], Asked(run_ids=frozenset({"r-own"})), NOW, GRACE) == SERVE
    assert decide(GRANT, ENDPOINTS["experiments/get"], Asked(experiment_id="1"), NOW, GRACE) == SERVE


@pytest.mark.parametrize(
    "name, asked",
    [
        ("runs/log-metric", Asked(run_ids=frozenset({"r-other"}))),
        ("runs/update", Asked(run_ids=frozenset({"r-other"}))),
        ("runs/get", Asked(run_ids=frozenset({"r-other"}))),
        # run_id its own, run_uuid (the field's old name, which a server may read) another's
        ("runs/log-metric", Asked(run_ids=frozenset({"r-own", "r-other"}))),
        ("experiments/get", Asked(experiment_id="2")),
        ("runs/set-tag", Asked(run_ids=frozenset({"r-own"}), tag_keys=("hangar.cost",))),
        ("runs/log-batch", Asked(run_ids=frozenset({"r-own"}), tag_keys=("ok", "mlflow.parentRunId"))),
        # its own run, but another's logged model (a metric's model_id, a model taken as input)
        ("runs/log-metric", Asked(run_ids=frozenset({"r-own"}), model_ids=frozenset({"m-other"}))),
        ("runs/log-inputs", Asked(run_ids=frozenset({"r-own"}), model_ids=frozenset({"m-other"}))),
    ],
)
def test_it_refuses_what_is_not_the_grants_own(name, asked):
    with pytest.raises(Refusal) as refused:
        decide(GRANT, ENDPOINTS[name], asked, NOW, GRACE)
    assert refused.value.status == 403 and refused.value.code == "PERMISSION_DENIED"


def test_an_ended_attempts_credential_is_refused_but_for_the_exit_update_within_the_grace():
    ended = Grant(**{**GRANT.__dict__, "live": False, "ended_at": NOW})
    own = Asked(run_ids=frozenset({"r-own"}))
    assert decide(ended, ENDPOINTS["runs/update"], own, NOW + GRACE, GRACE) == ACKNOWLEDGE
    assert decide(ended, ENDPOINTS["runs/get"], own, NOW, GRACE) == ACKNOWLEDGE  # read before it, for its log
    for name, when in [("runs/log-metric", NOW), ("runs/get", NOW + GRACE * 2), ("runs/update", NOW + GRACE * 2)]:
        with pytest.raises(Refusal, match="has ended") as refused:
            decide(ended, ENDPOINTS[name], own, when, GRACE)
        assert refused.value.status == 403


def test_a_request_that_names_no_run_is_a_400():
    with pytest.raises(Refusal) as refused:
        decide(GRANT, ENDPOINTS["runs/get"], Asked(), NOW, GRACE)
    assert (refused.value.status, refused.value.code) == (400, "INVALID_PARAMETER_VALUE")


# --- over HTTP, on the embedded store -------------------------------------------------


def test_a_job_writes_and_reads_its_own_run_through_mlflows_calls(two_jobs):
    (job, env), _ = two_jobs
    pb, run_id = protos(), env["MLFLOW_RUN_ID"]
    store = tracking.client()

    assert call(env, "runs/update", pb.UpdateRun(run_id=run_id, run_uuid=run_id, status=1, run_name="r1"))[0] == 200
    for step in range(3):
        message = pb.LogMetric(
            run_id=run_id, run_uuid=run_id, key="loss", value=1.0 / (step + 1), timestamp=1, step=step
        )
        assert call(env, "runs/log-metric", message) == (200, {})
    batch = pb.LogBatch(
        run_id=run_id,
        metrics=[pb.Metric(key="acc", value=0.5, timestamp=2, step=1)],
        params=[pb.Param(key="lr", value="0.1")],
        tags=[pb.RunTag(key="phase", value="train")],
    )
    assert call(env, "runs/log-batch", batch) == (200, {})
    assert call(env, "runs/log-parameter", pb.LogParam(run_id=run_id, key="seed", value="1")) == (200, {})
    assert call(env, "runs/set-tag", pb.SetTag(run_id=run_id, key="gone", value="x")) == (200, {})
    assert call(env, "runs/delete-tag", pb.DeleteTag(run_id=run_id, key="gone")) == (200, {})
    dataset = pb.DatasetInput(dataset=pb.Dataset(name="d", digest="abc", source_type="local", source="{}"))
    assert call(env, "runs/log-inputs", pb.LogInputs(run_id=run_id, datasets=[dataset])) == (200, {})

    run = store.get_run(run_id)
    assert run.data.metrics == {"loss": 1 / 3, "acc": 0.5} and run.data.params == {"lr": "0.1", "seed": "1"}
    assert run.data.tags["phase"] == "train" and "gone" not in run.data.tags and run.info.run_name == "r1"
    assert [d.dataset.digest for d in run.inputs.dataset_inputs] == ["abc"]
    status, got = call(env, "runs/get", method="GET", run_uuid=run_id, run_id=run_id)
    assert status == 200 and got["run"]["info"]["run_id"] == run_id
    status, got = call(env, "metrics/get-history", method="GET", run_id=run_id, metric_key="loss")
    assert [int(m["step"]) for m in got["metrics"]] == [0, 1, 2]  # int64 is a string in protobuf's JSON
    status, got = call(env, "experiments/get", method="GET", experiment_id=env["MLFLOW_EXPERIMENT_ID"])
    assert status == 200 and got["experiment"]["name"] == f"hangar/{job.project.slug}"
    # The job's page reads what it wrote.
    assert tracking.metrics(job)["series"]["loss"][2][:2] == [2, 1 / 3]


def test_a_jobs_credential_cannot_touch_another_jobs_run_which_stays_as_it_was(two_jobs):
    (_, mine), (other, theirs) = two_jobs
    pb, victim = protos(), theirs["MLFLOW_RUN_ID"]
    store = tracking.client()
    store.log_metric(victim, "loss", 0.25, step=1)
    store.log_param(victim, "lr", "0.1")
    before = store.get_run(victim)
    attacks = [
        ("runs/log-metric", pb.LogMetric(run_id=victim, key="loss", value=999, timestamp=1, step=2)),
        ("runs/log-metric", pb.LogMetric(run_id=mine["MLFLOW_RUN_ID"], run_uuid=victim, key="x", value=1, timestamp=1)),
        ("runs/log-batch", pb.LogBatch(run_id=victim, params=[pb.Param(key="owned", value="1")])),
        ("runs/log-parameter", pb.LogParam(run_id=victim, key="lr", value="9")),
        ("runs/set-tag", pb.SetTag(run_id=victim, key="owned", value="1")),
        ("runs/delete-tag", pb.DeleteTag(run_id=victim, key="hangar.job_id")),
        ("runs/update", pb.UpdateRun(run_id=victim, status=3)),  # FAILED
        ("runs/log-inputs", pb.LogInputs(run_id=victim)),
    ]
    for name, message in attacks:
        status, body = call(mine, name, message)
        assert (status, body["error_code"]) == (403, "PERMISSION_DENIED"), name
        assert f"not run {victim}" in body["message"]
    for name, query in [
        ("runs/get", {"run_id": victim}),
        ("metrics/get-history", {"run_id": victim, "metric_key": "loss"}),
    ]:
        assert call(mine, name, method="GET", **query)[0] == 403
    # The endpoints that name no run are not served at all: no search, no new runs, no deletes.
    experiment = mine["MLFLOW_EXPERIMENT_ID"]
    for name, message in [
        ("runs/search", pb.SearchRuns(experiment_ids=[experiment])),
        ("runs/create", pb.CreateRun(experiment_id=experiment)),
        ("runs/delete", pb.DeleteRun(run_id=victim)),
        ("experiments/create", pb.CreateExperiment(name="mine")),
    ]:
        status, body = call(mine, name, message)
        assert (status, body["error_code"]) == (404, "ENDPOINT_NOT_FOUND"), name
        assert "runs/log-metric" in body["message"]  # it says what is served
    after = store.get_run(victim)
    assert after.data.metrics == before.data.metrics and after.data.params == before.data.params
    assert after.data.tags == before.data.tags and after.info.status == before.info.status == "RUNNING"
    assert [m.value for m in store.get_metric_history(victim, "loss")] == [0.25]


def test_a_jobs_credential_cannot_reach_another_run_or_model_through_a_nested_id(two_jobs):
    """A batch's metrics carry a run id and a model id each, LogMetric a model id, LogInputs
    models: the store writes a metric onto the logged model it names, whoever's it is."""
    (_, mine), (other, theirs) = two_jobs
    pb, own, victim = protos(), mine["MLFLOW_RUN_ID"], theirs["MLFLOW_RUN_ID"]
    store = tracking.client()
    model = store.create_logged_model(theirs["MLFLOW_EXPERIMENT_ID"], name="theirs", source_run_id=victim)
    assert store.get_logged_model(model.model_id).metrics in (None, [])  # the setup: a model with no metric yet
    onto_model = pb.Metric(key="acc", value=0.0, timestamp=1, model_id=model.model_id)
    onto_run = pb.Metric(key="acc", value=0.0, timestamp=1, run_id=victim)
    attacks = [
        ("runs/log-metric", pb.LogMetric(run_id=own, key="acc", value=0.0, timestamp=1, model_id=model.model_id)),
        ("runs/log-batch", pb.LogBatch(run_id=own, metrics=[onto_model])),
        ("runs/log-batch", pb.LogBatch(run_id=own, metrics=[onto_run])),
        ("runs/log-inputs", pb.LogInputs(run_id=own, models=[pb.ModelInput(model_id=model.model_id)])),
    ]
    for name, message in attacks:
        status, body = call(mine, name, message)
        assert (status, body["error_code"]) == (403, "PERMISSION_DENIED"), (name, body)
        assert model.model_id in body["message"] or victim in body["message"]
    assert store.get_logged_model(model.model_id).metrics in (None, [])
    assert "acc" not in store.get_run(own).data.metrics and "acc" not in store.get_run(victim).data.metrics
    assert not (store.get_run(own).inputs.model_inputs or [])
    # The same calls without the other's ids are served.
    plain = pb.LogBatch(run_id=own, metrics=[pb.Metric(key="acc", value=0.5, timestamp=1, run_id=own)])
    assert call(mine, "runs/log-batch", plain) == (200, {})
    assert store.get_run(own).data.metrics["acc"] == 0.5


def test_a_call_reads_hangars_database_once(two_jobs, django_assert_num_queries):
    """The attempt, its credential's digests and its job's run in one primary-key read; the rest
    is the store's own call (on its own connection)."""
    (_, env), _ = two_jobs
    message = protos().LogMetric(run_id=env["MLFLOW_RUN_ID"], key="loss", value=1, timestamp=1)
    with django_assert_num_queries(1):
        assert call(env, "runs/log-metric", message) == (200, {})


def test_hangars_own_tags_on_the_jobs_run_are_hangars_to_write(two_jobs):
    (job, env), _ = two_jobs
    pb, run_id = protos(), env["MLFLOW_RUN_ID"]
    for key in ("hangar.cost", "hangar.job_id", "mlflow.parentRunId"):
        status, body = call(env, "runs/set-tag", pb.SetTag(run_id=run_id, key=key, value="0"))
        assert status == 403 and key in body["message"]
    assert call(env, "runs/delete-tag", pb.DeleteTag(run_id=run_id, key="hangar.job_id"))[0] == 403
    assert tracking.client().get_run(run_id).data.tags["hangar.job_id"] == str(job.pk)


def test_an_ended_attempts_credential_stops_working_but_its_exit_update_is_answered(two_jobs, node):
    (job, env), _ = two_jobs
    pb, run_id = protos(), env["MLFLOW_RUN_ID"]
    attempt = job.attempts.get()
    assert attempt.finish("failed", "user", "exited with code 1", 1)
    tracking.update_run(run_id, {"hangar.state": "failed"}, "FAILED")  # as the notifier does

    status, body = call(env, "runs/log-metric", pb.LogMetric(run_id=run_id, key="loss", value=1, timestamp=1))
    assert (status, body["error_code"]) == (403, "PERMISSION_DENIED") and "has ended" in body["message"]
    assert call(env, "metrics/get-history", method="GET", run_id=run_id, metric_key="loss")[0] == 403
    # MLflow's client ends its run as the process exits, after the agent may have ended the
    # attempt: answered without a write, so the run keeps the end Hangar wrote.
    status, body = call(env, "runs/update", pb.UpdateRun(run_id=run_id, status=3 - 1, end_time=1))  # FINISHED
    assert status == 200 and body["run_info"]["run_id"] == run_id
    assert tracking.client().get_run(run_id).info.status == "FAILED"
    # Past the grace, that is refused too; a later attempt's own credential works.
    type(attempt).objects.filter(pk=attempt.pk).update(finished_at=timezone.now() - timedelta(hours=1))
    assert call(env, "runs/update", pb.UpdateRun(run_id=run_id, status=2))[0] == 403
    assert call(env, "runs/get", method="GET", run_id=run_id)[0] == 403
    later = started(job, node)
    assert call(later, "runs/log-metric", pb.LogMetric(run_id=run_id, key="loss", value=1, timestamp=1))[0] == 200


def test_a_missing_or_forged_credential_is_unauthenticated(two_jobs, owner, project):
    (job, env), _ = two_jobs
    pb, run_id = protos(), env["MLFLOW_RUN_ID"]
    attempt_id = job.attempts.get().pk
    _, api_token = ApiToken.issue(owner, "mine", project=project)
    forged = [
        {},
        {"MLFLOW_TRACKING_TOKEN": "nonsense"},
        {"MLFLOW_TRACKING_TOKEN": f"hgm_{attempt_id}_guessed"},
        {"MLFLOW_TRACKING_TOKEN": f"hgm_{attempt_id + 1}_{env['MLFLOW_TRACKING_TOKEN'].rsplit('_', 1)[1]}"},
        {"MLFLOW_TRACKING_TOKEN": "hgm_99999999999999999999999_x"},
        {"MLFLOW_TRACKING_TOKEN": api_token},  # a user's API token is no job's credential
    ]
    for credential in forged:
        status, body = call(credential, "runs/log-metric", pb.LogMetric(run_id=run_id, key="x", value=1, timestamp=1))
        assert (status, body["error_code"]) == (401, "UNAUTHENTICATED"), credential
        assert "MLFLOW_TRACKING_TOKEN" in body["message"]
    assert call({}, "runs/search", pb.SearchRuns())[0] == 401  # nothing is said to a caller without one
    assert job.attempts.get().tracking_digests == [hash_token(env["MLFLOW_TRACKING_TOKEN"])]  # only a digest is kept


def test_a_malformed_request_is_a_400_in_mlflows_shape(two_jobs):
    (_, env), _ = two_jobs
    headers = {"HTTP_AUTHORIZATION": f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"}
    for body in ("{not json", "[1]", '{"run_id": 5, "key": {}}'):
        response = Client().post(PREFIX + "runs/log-metric", body, content_type="application/json", **headers)
        assert response.status_code == 400 and response.json()["error_code"] == "MALFORMED_REQUEST"
    response = Client().get(PREFIX + "runs/log-metric", **headers)  # a write asked with GET
    assert response.status_code == 404 and response.json()["error_code"] == "ENDPOINT_NOT_FOUND"


def test_a_store_that_is_down_is_a_503_that_names_no_address(two_jobs, settings):
    (_, env), _ = two_jobs
    settings.MLFLOW_TRACKING_URI = "http://hangar:s3cret@127.0.0.1:9"
    tracking._client = None
    message = protos().LogMetric(run_id=env["MLFLOW_RUN_ID"], key="loss", value=1, timestamp=1)
    status, body = call(env, "runs/log-metric", message)
    assert (status, body["error_code"]) == (503, "TEMPORARILY_UNAVAILABLE")
    assert "127.0.0.1" not in body["message"] and "s3cret" not in body["message"]


def test_the_proxy_is_reached_without_a_session_or_csrf_token(two_jobs):
    # A job has neither: the path is under /api/ (no login redirect) and the view takes no CSRF token.
    (_, env), _ = two_jobs
    client = Client(enforce_csrf_checks=True)
    response = client.get(PREFIX + "runs/get", {"run_id": env["MLFLOW_RUN_ID"]})
    assert response.status_code == 401 and response.json()["error_code"] == "UNAUTHENTICATED"


def test_the_proxy_url_is_this_hosts_web_tier_unless_set(monkeypatch):
    from portal import settings as hangar_settings

    monkeypatch.delenv("HANGAR_PUBLIC_URL", raising=False)
    monkeypatch.setenv("HANGAR_PORT", "8123")
    monkeypatch.setenv("HANGAR_HOST", "0.0.0.0")
    assert hangar_settings.local_web_url() == "http://127.0.0.1:8123"
    monkeypatch.setenv("HANGAR_HOST", "::1")
    assert hangar_settings.local_web_url() == "http://[::1]:8123"
    assert trackingproxy.ENDPOINTS.keys() >= {"runs/log-metric", "runs/update", "runs/get", "experiments/get"}
