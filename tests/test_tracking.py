"""MLflow runs per job, the metrics endpoint, the reproduce record, run again and compare."""

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from subprocess import PIPE

import pytest
from django.test import Client
from django.utils import timezone

from agent.runner import Runner
from jobs import reproduce, settling, tracking
from jobs.models import Environment, Job, JobCost
from portal.models import hash_token
from tests.factories import api_client, make_attempt, make_job, make_node, services_database
from tests.livestack import BASE_DIR


@pytest.fixture
def mlflow_store(settings, tmp_path):
    settings.MLFLOW_TRACKING_URI = f"sqlite:///{tmp_path}/mlflow.db"
    settings.DATA_DIR = tmp_path
    settings.HANGAR_MLFLOW = True
    tracking._client = None
    yield settings.MLFLOW_TRACKING_URI
    tracking._client = None


@pytest.fixture
def job(project, owner):
    return make_job(
        project,
        owner,
        code_version="abc123",
        environment=Environment.objects.get(name="ai"),
        env={"LR": "0.1", "HF_TOKEN": "s3cret"},
    )


def runner_env(job, node) -> dict:
    attempt = make_attempt(job, node, "preflight", started_at=timezone.now())
    attempt = type(attempt).objects.select_related("job__project", "node").get(pk=attempt.pk)
    return Runner(attempt).job_env()


def test_the_first_attempt_gets_a_tagged_run_in_the_projects_experiment(mlflow_store, settings, job, node):
    env = runner_env(job, node)
    job.refresh_from_db()
    # The job reaches its run through Hangar's tracking proxy with a credential of its attempt's,
    # never through the store: only the credential's digest is kept.
    assert env["MLFLOW_TRACKING_URI"] == settings.HANGAR_TRACKING_PROXY_URL != mlflow_store
    assert mlflow_store not in env.values()
    assert env["MLFLOW_TRACKING_TOKEN"].startswith(f"hgm_{job.attempts.get().pk}_")
    assert job.attempts.get().tracking_digests == [hash_token(env["MLFLOW_TRACKING_TOKEN"])]
    assert env["MLFLOW_RUN_ID"] == job.mlflow_run_id and env["MLFLOW_EXPERIMENT_ID"] == job.mlflow_experiment_id
    run = tracking.client().get_run(job.mlflow_run_id)
    assert tracking.client().get_experiment(run.info.experiment_id).name == "hangar/vision"
    tags = run.data.tags
    assert tags["hangar.job_id"] == str(job.pk) and tags["hangar.project"] == "vision"
    assert tags["hangar.user"] == "owner" and tags["hangar.gpu_type"] == "H100" and tags["hangar.nodes"] == "node-a"
    assert tags["hangar.code_version"] == "abc123" and tags["hangar.environment"] == "ai"
    assert tags["hangar.command"] == '["python", "train.py"]'


@pytest.fixture(params=["sqlite", "postgresql"])
def either_store(request, settings):
    """MLflow's store on the embedded SQLite file (mlflow_store), and on PostgreSQL (services
    mode's; another dialect and paramstyle for the statements Hangar runs on it)."""
    store = request.getfixturevalue("mlflow_store")
    if request.param == "sqlite":
        yield store
        return
    with services_database() as services:
        settings.MLFLOW_TRACKING_URI = services["DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://")
        try:
            yield settings.MLFLOW_TRACKING_URI
        finally:
            tracking.database_store().engine.dispose()  # its pooled connections, before the database goes
            tracking._client = None


def test_a_run_hangar_writes_reads_back_as_one_mlflow_makes(either_store):
    """The run is inserted with MLflow's own models (not its create_run, which reads the
    experiment and the run back): MLflow must read it exactly as one it made itself."""
    experiment = tracking.experiment_id("vision")
    tags = {"hangar.job_id": "7", "mlflow.user": "owner", "hangar.command": '["echo", "hi"]'}
    ours = tracking.client().get_run(tracking.create_run(experiment, "job-7 train", tags))
    theirs = tracking.client().create_run(experiment, run_name="job-7 train", tags=tags)
    for field in ("experiment_id", "user_id", "status", "lifecycle_stage", "run_name", "end_time"):
        assert getattr(ours.info, field) == getattr(theirs.info, field), field
    assert ours.info.artifact_uri == theirs.info.artifact_uri.replace(theirs.info.run_id, ours.info.run_id)
    assert ours.data.tags == theirs.data.tags and ours.data.tags["mlflow.runName"] == "job-7 train"
    assert abs(ours.info.start_time - theirs.info.start_time) < 60_000
    found = tracking.client().search_runs([experiment], filter_string="tags.`hangar.job_id` = '7'")
    assert {r.info.run_id for r in found} == {ours.info.run_id, theirs.info.run_id}
    tracking.client().set_terminated(ours.info.run_id, "FINISHED")
    assert tracking.client().get_run(ours.info.run_id).info.status == "FINISHED"


def test_a_run_hangar_updates_reads_back_as_one_mlflow_updated(mlflow_store):
    experiment = tracking.experiment_id("vision")
    ours, theirs = (tracking.create_run(experiment, "job-8", {"hangar.state": "running"}) for _ in range(2))
    tracking.update_run(ours, {"hangar.state": "queued", "hangar.cost": "0.5000"})  # a requeue: still running
    assert tracking.client().get_run(ours).info.status == "RUNNING"
    tracking.update_run(ours, {"hangar.state": "failed", "hangar.cost": "1.2500"}, "FAILED")
    from mlflow.entities import RunTag

    tags = [RunTag("hangar.state", "failed"), RunTag("hangar.cost", "1.2500")]
    tracking.client().log_batch(theirs, tags=tags)
    tracking.client().set_terminated(theirs, status="FAILED")
    ours, theirs = tracking.client().get_run(ours), tracking.client().get_run(theirs)
    assert ours.data.tags == theirs.data.tags and ours.data.tags["hangar.state"] == "failed"
    assert ours.info.status == theirs.info.status == "FAILED"
    assert ours.info.end_time and abs(ours.info.end_time - theirs.info.end_time) < 60_000
    tracking.client().delete_run(ours.info.run_id)
    with pytest.raises(Exception, match="was deleted"):
        tracking.update_run(ours.info.run_id, {"hangar.state": "succeeded"}, "FINISHED")


def test_jobs_starting_at_once_look_their_projects_experiment_up_once(settings, monkeypatch):
    import threading

    settings.MLFLOW_TRACKING_URI = "sqlite:////nonexistent/lookups.db"
    looked_up = []

    def slow_lookup(name, slug):
        looked_up.append(name)
        time.sleep(0.2)  # the others arrive while it runs
        return "7"

    monkeypatch.setattr(tracking, "_find_or_create_experiment", slow_lookup)
    monkeypatch.setattr(tracking, "_experiments", {})
    found = []
    starts = [threading.Thread(target=lambda: found.append(tracking.experiment_id("vision"))) for _ in range(8)]
    for thread in starts:
        thread.start()
    for thread in starts:
        thread.join()
    assert found == ["7"] * 8 and looked_up == ["hangar/vision"]


def test_jobs_starting_at_once_share_one_failed_lookup_and_the_next_job_looks_again(settings, monkeypatch):
    # MLflow down: the jobs waiting on the lookup get its error at once, not a timeout each in turn.
    import threading

    settings.MLFLOW_TRACKING_URI = "sqlite:////nonexistent/lookups.db"
    looked_up = []

    def unreachable(name, slug):
        looked_up.append(name)
        time.sleep(0.3)
        raise ConnectionError("MLflow is down")

    monkeypatch.setattr(tracking, "_find_or_create_experiment", unreachable)
    monkeypatch.setattr(tracking, "_experiments", {})
    errors = []

    def start():
        try:
            tracking.experiment_id("vision")
        except ConnectionError as exc:
            errors.append(str(exc))

    starts = [threading.Thread(target=start) for _ in range(8)]
    for thread in starts:
        thread.start()
    for thread in starts:
        thread.join()
    assert errors == ["MLflow is down"] * 8 and looked_up == ["hangar/vision"]  # one wait, not eight in turn
    with pytest.raises(ConnectionError):
        tracking.experiment_id("vision")
    assert len(looked_up) == 2 and tracking._experiments == {}  # no failed lookup is kept


def test_a_later_attempt_tags_the_same_run_which_runs_again(mlflow_store, job, node):
    first = runner_env(job, node)
    job.refresh_from_db()
    job.attempts.update(state="lost", finished_at=timezone.now())  # the first attempt was lost, the job requeued
    tracking.update_run(job.mlflow_run_id, {"hangar.state": "queued"})
    second = make_attempt(job, make_node("node-b"), "preflight", started_at=timezone.now())
    second = type(second).objects.select_related("job__project", "node").get(pk=second.pk)
    env = Runner(second).job_env()
    assert env["MLFLOW_RUN_ID"] == first["MLFLOW_RUN_ID"]
    run = tracking.client().get_run(first["MLFLOW_RUN_ID"])
    assert run.data.tags["hangar.attempt"] == str(second.number) and run.data.tags["hangar.nodes"] == "node-b"
    assert run.info.status == "RUNNING" and run.info.end_time is None
    assert env["MLFLOW_TRACKING_TOKEN"] != first["MLFLOW_TRACKING_TOKEN"]  # each attempt has its own


def test_a_project_whose_jobs_have_no_network_gets_a_run_but_no_mlflow_variables(mlflow_store, job, node):
    # Loopback only: the proxy is out of reach, so nothing that would fail at the first log_metric.
    type(job.project).objects.filter(pk=job.project_id).update(network="none")
    job.project.refresh_from_db()
    env = runner_env(job, node)
    job.refresh_from_db()
    assert not any(name.startswith("MLFLOW_") for name in env) and job.mlflow_run_id
    assert "network is `none`" in tracking.left_out(job) and not job.attempts.get().tracking_digests


def test_every_rank_of_an_attempt_gets_its_own_credential_and_both_work(mlflow_store, job, node):
    attempt = make_attempt(job, node, "preflight", started_at=timezone.now())
    first, second = tracking.issue_credential(attempt), tracking.issue_credential(attempt)
    attempt.refresh_from_db()
    assert first != second and attempt.tracking_digests == [hash_token(first), hash_token(second)]
    attempt.finish("failed", "infra", "node lost")
    assert tracking.issue_credential(attempt) is None


def test_an_experiment_deleted_in_mlflow_is_said_on_the_job_and_restored_by_the_next(mlflow_store, job, node):
    first = runner_env(job, node)
    tracking.client().delete_experiment(first["MLFLOW_EXPERIMENT_ID"])
    second = make_job(job.project, job.submitted_by)
    assert "MLFLOW_RUN_ID" not in runner_env(second, node)
    second.refresh_from_db()
    assert "was deleted" in second.tracking_error and not second.mlflow_run_id
    third = make_job(job.project, job.submitted_by)
    env = runner_env(third, node)
    assert env["MLFLOW_EXPERIMENT_ID"] == first["MLFLOW_EXPERIMENT_ID"]
    assert tracking.client().get_experiment(env["MLFLOW_EXPERIMENT_ID"]).lifecycle_stage == "active"
    assert tracking.client().get_run(env["MLFLOW_RUN_ID"]).info.status == "RUNNING"


def test_the_embedded_store_is_written_ahead_so_readers_do_not_wait_for_writers(mlflow_store, tmp_path):
    import sqlite3

    tracking.client()
    assert sqlite3.connect(tmp_path / "mlflow.db").execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_hangars_writes_on_the_embedded_store_keep_what_mlflows_sessions_set(mlflow_store):
    # create_run and update_run write on the store's engine, not through MLflow's sessions,
    # which set these on each use: every connection of the engine has them from its start.
    from sqlalchemy import text

    engine = tracking.database_store().engine
    engine.dispose()  # a connection of its own, that no MLflow session has used yet
    with engine.connect() as db:
        assert db.execute(text("PRAGMA foreign_keys")).scalar() == 1
        assert db.execute(text("PRAGMA busy_timeout")).scalar() == 20000


def test_the_run_gets_the_final_status_and_the_cost_when_the_end_is_settled(
    mlflow_store, settings, job, node, django_capture_on_commit_callbacks
):
    runner_env(job, node)
    job.refresh_from_db()
    tracking.client().log_metric(job.mlflow_run_id, "loss", 0.5, step=1)
    attempt = job.attempts.get()
    settings.HANGAR_SETTLE_DELAY_SECONDS = 1.0
    queue = settings.BROKER_DIR / "queue"
    before = set(queue.glob("*.hangar.tracking.msg"))
    with django_capture_on_commit_callbacks(execute=True):
        attempt.finish("failed", "user", "exited with code 1", 1)
    # The end sends nothing: the notifier settles it once it is a second old.
    assert set(queue.glob("*.hangar.tracking.msg")) <= before
    assert tracking.client().get_run(job.mlflow_run_id).info.status == "RUNNING"
    assert settling.settle_due() == [] and not JobCost.objects.filter(pk=job.pk).exists()
    assert settling.settle_due(now=timezone.now() + timedelta(seconds=1.1)) == [attempt.pk]
    run = tracking.client().get_run(job.mlflow_run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["hangar.cost"] == f"{JobCost.objects.get(pk=job.pk).cost:.4f}"
    found = api_client(job.submitted_by).get(f"/api/v1/jobs/{job.pk}/metrics/").json()
    assert found["available"] and found["series"]["loss"][0][:2] == [1, 0.5]
    assert found["figure"]["data"][0]["y"] == [0.5]


def test_an_update_written_while_the_job_moved_on_is_written_again(mlflow_store, job, node, monkeypatch):
    # Two updates of one job in flight at once: this one read "queued", and by the time it wrote,
    # the next attempt had ended the job. It writes again what the job now says.
    runner_env(job, node)
    job.refresh_from_db()
    Job.objects.filter(pk=job.pk).update(state="queued")
    update_run = tracking.update_run
    calls = []

    def update_then_the_job_ends(run_id, tags, status=None):
        calls.append(tags["hangar.state"])
        update_run(run_id, tags, status)
        Job.objects.filter(pk=job.pk).update(state="succeeded")

    monkeypatch.setattr(tracking, "update_run", update_then_the_job_ends)
    tracking.attempt_finished(job.pk)
    run = tracking.client().get_run(job.mlflow_run_id)
    assert calls == ["queued", "succeeded"]
    assert run.data.tags["hangar.state"] == "succeeded" and run.info.status == "FINISHED"


def test_the_notifier_settles_a_backlog_in_one_round(mlflow_store, settings, job, node, monkeypatch):
    # After the notifier was down: more ended attempts than one batch, all settled at its next look.
    from jobs.management.commands import notifier

    settings.HANGAR_SETTLE_DELAY_SECONDS = 0
    monkeypatch.setattr(settling, "SETTLE_BATCH", 2)
    runner_env(job, node)
    job.refresh_from_db()
    job.attempts.get().finish("failed", "infra", "node lost")
    for _ in range(4):
        attempt = make_attempt(job, node, "running")
        assert attempt.finish("failed", "infra", "node lost")
    assert notifier.settle_round(threading.Event()) == 5
    assert JobCost.objects.get(pk=job.pk).attempts == 5
    assert tracking.client().get_run(job.mlflow_run_id).data.tags["hangar.state"] == Job.objects.get(pk=job.pk).state


def test_an_unreachable_mlflow_does_not_stop_the_job_and_the_page_says_why(settings, job, node, owner):
    settings.MLFLOW_TRACKING_URI = "http://127.0.0.1:9"
    tracking._client = None
    try:
        env = runner_env(job, node)
    finally:
        tracking._client = None
    assert "MLFLOW_RUN_ID" not in env and env["HANGAR_JOB_ID"] == str(job.pk)
    job.refresh_from_db()
    assert "MLflow at http://127.0.0.1:9 failed" in job.tracking_error
    client = Client()
    client.force_login(owner)
    assert "Metrics unavailable: MLflow at http://127.0.0.1:9 failed" in client.get(f"/jobs/{job.pk}/").content.decode()
    found = api_client(owner).get(f"/api/v1/jobs/{job.pk}/metrics/").json()
    assert not found["available"] and "http://127.0.0.1:9" in found["reason"]


def test_metrics_are_scoped_to_the_callers_projects(job, outsider, other_project):
    assert api_client(outsider).get(f"/api/v1/jobs/{job.pk}/metrics/").status_code == 404


def test_the_reproduce_record_masks_secrets(job, node, owner):
    make_attempt(job, node, "running", gpu_indices=[2, 3])
    record = reproduce.record(job)
    assert record["env"] == {"LR": "0.1", "HF_TOKEN": reproduce.MASK}
    assert record["placement"] == [
        {
            "attempt": 1,
            "node": "node-a",
            "gpu_type": "H100",
            "gpu_indices": [2, 3],
            "ranks": [{"rank": 0, "node": "node-a", "gpu_indices": [2, 3]}],
        }
    ]
    client = Client()
    client.force_login(owner)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    section = page.split('id="job-reproduce"', 1)[1].split("</section>", 1)[0]
    assert "abc123" in section and "HF_TOKEN=" + reproduce.MASK in section and "s3cret" not in section
    assert "Run again" in section


def test_run_again_clones_the_spec(settings, job, node, owner):
    settings.HANGAR_MLFLOW = False
    client = Client()
    client.force_login(owner)
    response = client.post(f"/jobs/{job.pk}/run-again/")
    clone = Job.objects.exclude(pk=job.pk).get()
    assert response.status_code == 302 and response.url == f"/jobs/{clone.pk}/"
    for name in reproduce.SPEC_FIELDS:
        assert getattr(clone, name) == getattr(job, name), name
    assert clone.submitted_by == owner and clone.state == "queued"


def test_run_again_and_compare_are_refused_outside_ones_projects(job, outsider, other_project):
    client = Client()
    client.force_login(outsider)
    assert client.post(f"/jobs/{job.pk}/run-again/").status_code == 404
    assert client.get(f"/jobs/compare/?a={job.pk}&b={job.pk}").status_code == 404


def test_compare_shows_spec_differences(settings, job, project, owner):
    settings.HANGAR_MLFLOW = False
    other = make_job(project, owner, code_version="def456", environment=job.environment, env=job.env)
    client = Client()
    client.force_login(owner)
    response = client.get(f"/jobs/compare/?a={job.pk}&b={other.pk}")
    differs = {row["field"] for row in response.context["spec"] if row["differs"]}
    assert differs == {"code_version"}


def test_the_job_page_links_to_the_mlflow_ui_when_one_is_configured(settings, job, owner):
    settings.HANGAR_MLFLOW_UI_URL = "http://mlflow.example:5000"
    Job.objects.filter(pk=job.pk).update(mlflow_experiment_id="3", mlflow_run_id="abc")
    client = Client()
    client.force_login(owner)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'href="http://mlflow.example:5000/#/experiments/3/runs/abc"' in page
    assert 'data-metrics-url="/api/v1/jobs/' in page


def test_the_reproduce_record_and_card_show_every_ranks_node(job, node, owner):
    other = make_node("node-b")
    placement = [{"rank": 0, "node_id": node.pk, "node": node.name, "gpus": [0, 1]},
                 {"rank": 1, "node_id": other.pk, "node": "node-b", "gpus": [2, 3]}]  # fmt: skip
    make_attempt(job, node, "running", gpu_indices=[0, 1], placement=placement)

    ranks = reproduce.record(job)["placement"][0]["ranks"]
    assert [(r["rank"], r["node"], r["gpu_indices"]) for r in ranks] == [(0, "node-a", [0, 1]), (1, "node-b", [2, 3])]
    client = Client()
    client.force_login(owner)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    section = page.split('id="job-reproduce"', 1)[1].split("</section>", 1)[0]
    assert "rank 0 node-a GPUs 0,1; rank 1 node-b GPUs 2,3" in section


def test_the_metrics_chart_has_a_titled_panel_per_metric_a_legend_and_a_log_toggle():
    figure = tracking.metrics_figure({"loss": [[0, 2.0, 0], [1, 1.0, 0]], "accuracy": [[0, 0.1, 0], [1, 0.6, 0]]})

    layout = figure["layout"]
    assert [t["name"] for t in figure["data"]] == ["loss", "accuracy"]
    assert [t["yaxis"] for t in figure["data"]] == ["y", "y2"]  # a panel each
    assert layout["yaxis"]["title"]["text"] == "loss" and layout["yaxis2"]["title"]["text"] == "accuracy"
    assert layout["xaxis2"]["title"]["text"] == "step" and layout["showlegend"] is True
    buttons = layout["updatemenus"][0]["buttons"]
    assert [b["label"] for b in buttons] == ["linear", "log"]
    assert buttons[1]["args"][0] == {"yaxis.type": "log", "yaxis2.type": "log"}


def test_a_hangar_process_outside_ci_starts_no_mlflow_telemetry(tmp_path):
    # MLflow's import starts a client that reports usage to its makers' servers, unless it thinks it
    # runs in CI or under pytest: so a child with those markers removed, as on an operator's host.
    markers = {"CI", "PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"}
    env = {k: v for k, v in os.environ.items() if k not in markers}
    env.update(HANGAR_DATA_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="portal.settings")
    script = (
        "import django; django.setup()\n"
        "from jobs import tracking\n"
        "import mlflow\n"
        "from mlflow.telemetry.client import get_telemetry_client\n"
        "print(get_telemetry_client() is None)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=BASE_DIR, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"


IMPORTS_BEFORE_THE_CLIENT = """
import os, sys, types
sys.path.insert(0, os.getcwd())
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
import django
django.setup()
from jobs import logmetrics, tracking

seen = []

def client():  # records whether MLflow was imported before the client, then stops the call
    seen.append("mlflow" in sys.modules)
    raise RuntimeError("stopped at the client")

tracking.client = client
one_job = types.SimpleNamespace(pk=1, mlflow_run_id="r1")
query = types.SimpleNamespace(first=lambda: one_job, update=lambda **_: 0)
tracking.Job = types.SimpleNamespace(objects=types.SimpleNamespace(filter=lambda **_: query))
calls = {
    "experiment": lambda: tracking.experiment_id("p"),
    "store": tracking.database_store,
    "metrics from the log": lambda: logmetrics.send("r1", [logmetrics.Point("loss", 1.0, 1, 0)]),
    "diagnosis": lambda: tracking.tag_diagnosis(1, {"category": "c", "summary": "s", "hint": "h"}),
}
for name, call in calls.items():
    try:
        call()
    except RuntimeError:
        pass
    print(name, "imported MLflow first" if seen.pop() else "ok")
"""


def test_mlflow_is_imported_by_the_client_alone(tmp_path):
    # An agent's MLflow warm-up thread imports MLflow in client(), under its lock. A job's thread
    # that imported it too, at once, met it in MLflow's circular imports: Python handed one of them
    # a half-made module, and every later job of that agent ran untracked. So no caller may import
    # MLflow before client() has: here no MLflow module is loaded when each first calls it.
    env = {**os.environ, "HANGAR_DATA_DIR": str(tmp_path), "HANGAR_MLFLOW": "1"}
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_BEFORE_THE_CLIENT], cwd=BASE_DIR, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["experiment ok", "store ok", "metrics from the log ok", "diagnosis ok"]


OPEN_THE_STORE = """
import os, sys, time
sys.path.insert(0, os.getcwd())
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
import django
django.setup()
import mlflow.tracking  # imported before the start: the processes open the store together
from jobs import tracking
time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
print(tracking.client().get_experiment_by_name("Default").experiment_id)
"""


def test_hosts_opening_a_fresh_postgresql_store_at_once_create_it_once(tmp_path):
    """Agents on several hosts warm up against one fresh MLflow database: each opens it at once,
    each from its own data directory (so no shared file lock), and every one gets the store.
    Without the lock in the database, MLflow's table creation raced (a duplicate `experiments`
    type, a duplicate Default experiment) and the losers had no MLflow."""
    with services_database() as services:
        mlflow_db = services["DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://")
        start_at = time.time() + 8  # Django and MLflow imported by then
        hosts = []
        for host in range(4):
            data_dir = tmp_path / f"host{host}"
            data_dir.mkdir()
            env = {**os.environ, "HANGAR_DATA_DIR": str(data_dir), "MLFLOW_TRACKING_URI": mlflow_db}
            opens = [sys.executable, "-c", OPEN_THE_STORE, str(start_at)]
            hosts.append(subprocess.Popen(opens, cwd=BASE_DIR, env=env, stdout=PIPE, stderr=PIPE, text=True))
        results = [host.communicate(timeout=120) for host in hosts]
    assert [host.returncode for host in hosts] == [0] * 4, [err[-2000:] for _, err in results]
    assert {out.strip() for out, _ in results} == {"0"}


def test_a_store_lock_held_for_good_by_someone_else_delays_the_first_open_only_so_long(settings, tmp_path, monkeypatch):
    """Anyone reaching the store's database can take the advisory lock (a job given its URI):
    held for good, it must not stop Hangar's processes from opening MLflow, nor jobs from starting."""
    import psycopg

    with services_database() as services:
        store = services["DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://")
        settings.DATA_DIR, settings.MLFLOW_TRACKING_URI = tmp_path, store
        monkeypatch.setattr(tracking, "STORE_LOCK_WAIT_SECONDS", 0.5)
        with psycopg.connect(services["DATABASE_URL"], autocommit=True) as squatter:
            squatter.execute("SELECT pg_advisory_lock(%s)", [tracking.STORE_LOCK_KEY])
            started = time.monotonic()
            with tracking.store_creation_lock(store):
                waited = time.monotonic() - started
            assert 0.5 <= waited < 10
