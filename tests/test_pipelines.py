"""Pipelines: stages as ordinary jobs waiting on the jobs of the stages they need, one
shared directory per run, cancel, run again; bad input refused by stage and field."""

import os
import shutil
from pathlib import Path

import pytest
from rest_framework.exceptions import ValidationError

from jobs import pipelines, reproduce
from jobs.models import AttemptState, FailureClass, Job, JobState, PipelineRun, PipelineStage, pipeline_state
from tests.factories import api_client, make_attempt, make_job
from tests.test_sandbox import as_root, shell, uid_printed
from tests.test_sandbox import run as run_sandboxed

URL = "/api/v1/pipelines/"


def document(**stages) -> dict:
    stages = stages or {
        "prepare": {"command": ["python", "prep.py"]},
        "train": {"needs": ["prepare"], "command": ["python", "train.py", "--epochs", "${params.EPOCHS}"]},
        "evaluate": {"needs": ["train"], "command": ["python", "eval.py"]},
    }
    return {"name": "tiny", "project": "vision", "params": {"EPOCHS": 3}, "stages": stages}


def post(user, body, **headers):
    return api_client(user).post(URL, body, format="json", **headers)


def fields_of(response) -> dict[str, str]:
    return {e["field"]: e["message"] for e in response.json()["errors"]}


@pytest.fixture
def pipeline_root(settings, tmp_path):
    settings.HANGAR_PIPELINE_ROOT = tmp_path / "pipelines"
    return settings.HANGAR_PIPELINE_ROOT


def test_the_plan_orders_stages_and_substitutes_params():
    planned = pipelines.plan(
        document(
            evaluate={"needs": ["train"], "command": ["eval"]},
            train={"needs": "prepare", "command": ["train", "--epochs=${params.EPOCHS}"], "env": {"LR": "0.1"}},
            prepare={"command": ["prep"]},
        )
    )
    assert [s.name for s in planned.stages] == ["prepare", "train", "evaluate"]
    train = planned.stages[1]
    assert train.needs == ["prepare"] and train.spec["command"] == ["train", "--epochs=3"]
    assert train.spec["env"] == {"EPOCHS": "3", "LR": "0.1"}  # params reach every stage as env; its own env wins


@pytest.mark.parametrize(
    ("stages", "field", "message"),
    [
        ({"a": {"needs": ["b"], "command": ["x"]}, "b": {"needs": ["a"], "command": ["x"]}}, "needs",
         "a cycle: "),
        ({"a": {"needs": ["nope"], "command": ["x"]}}, "stages.a.needs", "'nope' is not a stage; stages are a"),
        ({"a": {"needs": ["a"], "command": ["x"]}}, "stages.a.needs", "a stage cannot need itself"),
        ({"A b": {"command": ["x"]}}, "stages.A b", "is not a stage name"),
        ({"a": {"command": ["x", "${params.LR}"]}}, "stages.a.command[1]", "${params.LR} is not a parameter"),
        ({"a": {"command": ["x"], "depends_on": [{"job": 1}]}}, "stages.a.depends_on", "is set from needs"),
        ({}, "stages", "is required"),
    ],
)  # fmt: skip
def test_the_plan_refuses_a_bad_shape_naming_the_stage_and_field(stages, field, message):
    with pytest.raises(ValidationError) as raised:
        pipelines.plan({**document(), "stages": stages})
    errors = {key: str(value[0]) for key, value in raised.value.detail.items()}
    found = [key for key in errors if key.endswith(field)]
    assert found and message in errors[found[0]], errors


def test_the_pipeline_state_is_read_from_its_stages():
    assert pipeline_state(["succeeded", "running"]) == "running"
    assert pipeline_state(["succeeded", "failed", "cancelled"]) == "failed"
    assert pipeline_state(["succeeded", "cancelled"]) == "cancelled"
    assert pipeline_state(["succeeded", "succeeded"]) == "succeeded"


def test_a_pipeline_becomes_jobs_that_wait_on_the_stages_they_need(owner, project, node, pipeline_root):
    response = post(owner, document())
    assert response.status_code == 201, response.content
    body = response.json()
    assert [s["name"] for s in body["stages"]] == ["prepare", "train", "evaluate"]
    assert body["state"] == "running" and body["urls"]["page"] == f"/pipelines/{body['id']}/"
    jobs = {s["name"]: Job.objects.get(pk=s["job"]) for s in body["stages"]}
    assert jobs["prepare"].state == JobState.QUEUED and jobs["prepare"].depends_on == []
    assert jobs["train"].state == JobState.BLOCKED
    assert jobs["train"].depends_on == [{"job": jobs["prepare"].pk, "on": "succeeded"}]
    assert jobs["evaluate"].depends_on == [{"job": jobs["train"].pk, "on": "succeeded"}]
    assert jobs["train"].command == ["python", "train.py", "--epochs", "3"] and jobs["train"].env == {"EPOCHS": "3"}
    assert jobs["train"].name == "train"
    directory = Path(body["directory"])
    assert directory.is_dir() and directory.parent == pipeline_root

    run = PipelineRun.objects.get(pk=body["id"])
    assert pipelines.stage_env(jobs["train"]) == {
        "HANGAR_PIPELINE_DIR": str(directory),
        "HANGAR_PIPELINE_RUN": str(run.pk),
        "HANGAR_PIPELINE_STAGE": "train",
    }
    record = reproduce.record(jobs["evaluate"])["pipeline"]
    assert record["run"] == run.pk and record["stage"] == "evaluate"
    assert record["upstream"] == [{"stage": "train", "job": jobs["train"].pk}]
    assert api_client(owner).get(f"{URL}{run.pk}/").json()["stages"][2]["job"] == jobs["evaluate"].pk


def test_a_stage_the_job_spec_refuses_creates_nothing(owner, project, node, pipeline_root):
    before = (Job.objects.count(), PipelineRun.objects.count())
    bad = document()
    bad["stages"]["train"]["gpus_per_node"] = 0
    bad["stages"]["evaluate"]["max_retries"] = "many"
    response = post(owner, bad)
    assert response.status_code == 400
    fields = fields_of(response)
    assert "must be at least 1 GPU" in fields["stages.train.gpus_per_node"]
    assert "stages.evaluate.max_retries" in fields  # every stage's problems at once

    too_big = document()
    too_big["stages"]["evaluate"]["gpus_per_node"] = 64  # passes the shape, refused at submit: after two jobs
    response = post(owner, too_big)
    assert response.status_code == 400
    assert "the largest node has 4" in fields_of(response)["stages.evaluate.gpus_per_node"]
    assert (Job.objects.count(), PipelineRun.objects.count()) == before  # nothing half-created
    assert not pipeline_root.exists() or not any(pipeline_root.iterdir())


def test_bad_pipelines_are_refused_whole(owner, outsider, project, other_project, node, pipeline_root):
    cycle = {"a": {"needs": ["c"], "command": ["x"]}, "b": {"needs": ["a"], "command": ["x"]},
             "c": {"needs": ["b"], "command": ["x"]}}  # fmt: skip
    response = post(owner, document(**cycle))
    assert response.status_code == 400 and "a cycle: " in response.json()["message"]
    response = post(owner, {**document(), "project": "nlp"})
    assert response.status_code == 400 and "no project 'nlp' that you can submit to" in fields_of(response)["project"]
    response = post(owner, {**document(), "colour": "blue"})
    assert "is not a pipeline field" in fields_of(response)["colour"]
    duplicate = b'{"project": "vision", "stages": {"a": {"command": ["x"]}, "a": {"command": ["y"]}}}'
    response = api_client(owner).post(URL, duplicate, content_type="application/json")
    assert response.status_code == 400 and "'a' is given twice" in response.json()["message"]
    assert not Job.objects.exists() and not PipelineRun.objects.exists()


def test_a_failed_stage_cancels_the_stages_after_it_with_the_reason(
    owner, project, node, pipeline_root, django_capture_on_commit_callbacks
):
    run = PipelineRun.objects.get(pk=post(owner, document()).json()["id"])
    prepare, train, evaluate = [s.job for s in run.ordered_stages()]
    with django_capture_on_commit_callbacks(execute=True):
        make_attempt(prepare, node, AttemptState.RUNNING).finish(AttemptState.FAILED, FailureClass.USER, "exit 1")
    train.refresh_from_db()
    evaluate.refresh_from_db()
    assert train.state == JobState.CANCELLED and f"job {prepare.pk} failed" in train.state_reason
    assert evaluate.state == JobState.CANCELLED and f"job {train.pk} cancelled" in evaluate.state_reason
    assert run.state == "failed"


def test_cancel_stops_the_running_stage_and_the_blocked_ones(owner, teammate, project, node, pipeline_root):
    run_id = post(owner, document()).json()["id"]
    run = PipelineRun.objects.get(pk=run_id)
    prepare = run.ordered_stages()[0].job
    make_attempt(prepare, node, AttemptState.RUNNING)

    assert api_client(teammate).post(f"{URL}{run_id}/cancel/", {}, format="json").status_code == 403
    response = api_client(owner).post(f"{URL}{run_id}/cancel/", {"reason": "wrong data"}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["cancelled_stages"] == ["prepare", "train", "evaluate"]
    states = {s.name: (s.job.state, s.job.state_reason) for s in run.ordered_stages()}
    assert states["train"] == (JobState.CANCELLED, "wrong data") and states["evaluate"][0] == JobState.CANCELLED
    assert prepare.attempts.get().cancel_requested_at is not None  # its agent stops it (SIGTERM, grace)


def test_run_again_from_a_stage_reuses_the_earlier_stages_once_every_stage_ended(owner, project, node, pipeline_root):
    earlier = PipelineRun.objects.get(pk=post(owner, document()).json()["id"])
    prepare, train, evaluate = [s.job for s in earlier.ordered_stages()]
    client = api_client(owner)

    response = client.post(f"{URL}{earlier.pk}/rerun/", {"from_stage": "evaluate"}, format="json")
    assert response.status_code == 409 and response.json()["code"] == "pipeline_running"
    assert f"stage prepare (job {prepare.pk}) is queued" in fields_of(response)["stages.prepare"]
    make_attempt(prepare, node, AttemptState.RUNNING).finish(AttemptState.SUCCEEDED, "", "done")
    make_attempt(train, node, AttemptState.RUNNING).finish(AttemptState.FAILED, FailureClass.USER, "exit 1")
    evaluate.cancel(owner, "train failed")
    assert client.post(f"{URL}{earlier.pk}/rerun/", {"from_stage": "deploy"}, format="json").status_code == 400
    response = client.post(f"{URL}{earlier.pk}/rerun/", {"from_stage": "evaluate"}, format="json")
    assert response.status_code == 400 and "stage train (job" in fields_of(response)["from_stage"]  # not succeeded

    response = client.post(f"{URL}{earlier.pk}/rerun/", {"from_stage": "train"}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    stages = {s["name"]: s for s in body["stages"]}
    assert stages["prepare"]["job"] == prepare.pk and stages["prepare"]["reused"] and not stages["train"]["reused"]
    again = Job.objects.get(pk=stages["train"]["job"])
    assert again.pk != train.pk and again.command == train.command and again.state == JobState.QUEUED
    assert body["rerun_of"] == earlier.pk and body["from_stage"] == "train"
    # The copy is its first stage's, on its node, as its uid (tests/test_pipeline_rerun_security.py).
    assert body["copy"] == {"state": "waiting", "bytes": 0, "total": 0, "reason": "", "from_run": earlier.pk}
    assert Path(body["directory"]).parent == pipeline_root and not Path(body["directory"]).exists()
    assert pipelines.stage_env(prepare)["HANGAR_PIPELINE_DIR"] == earlier.directory  # a reused job keeps its run's

    whole = client.post(f"{URL}{earlier.pk}/rerun/", {}, format="json").json()
    assert not any(s["reused"] for s in whole["stages"]) and whole["copy"] is None
    assert not any(Path(whole["directory"]).iterdir())


def test_a_retried_submit_with_the_same_key_returns_the_first_run(owner, project, node, pipeline_root):
    first = post(owner, document(), HTTP_IDEMPOTENCY_KEY="pipe-1")
    again = post(owner, document(), HTTP_IDEMPOTENCY_KEY="pipe-1")
    assert (first.status_code, again.status_code) == (201, 200) and first.json()["id"] == again.json()["id"]
    other = post(owner, document(a={"command": ["x"]}), HTTP_IDEMPOTENCY_KEY="pipe-1")
    assert other.status_code == 409
    assert PipelineStage.objects.count() == 3


def test_another_projects_pipeline_answers_404(owner, outsider, project, node, pipeline_root):
    run_id = post(owner, document()).json()["id"]
    client = api_client(outsider)
    assert client.get(f"{URL}{run_id}/").status_code == 404
    assert client.post(f"{URL}{run_id}/cancel/", {}, format="json").status_code == 404
    assert client.post(f"{URL}{run_id}/rerun/", {}, format="json").status_code == 404
    assert client.get(URL).json()["results"] == []
    assert PipelineRun.objects.count() == 1


def test_a_pipeline_depends_only_on_its_own_jobs(owner, project, node, pipeline_root):
    make_job(project, owner)
    response = post(owner, document(a={"command": ["x"], "depends_on": [{"job": 1}]}))
    assert response.status_code == 400 and "is set from needs" in fields_of(response)["stages.a.depends_on"]


def test_the_run_page_draws_the_dag_links_each_stage_and_cancels_and_reruns(
    owner, outsider, project, node, pipeline_root, client
):
    run = PipelineRun.objects.get(pk=post(owner, document()).json()["id"])
    prepare, train, evaluate = [s.job for s in run.ordered_stages()]
    make_attempt(prepare, node, AttemptState.RUNNING).finish(AttemptState.SUCCEEDED, "", "done")
    client.force_login(owner)

    page = client.get(f"/pipelines/{run.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    for job in (prepare, train, evaluate):
        assert f'href="/jobs/{job.pk}/"' in html
    figure = page.context["figure"]
    markers = figure["data"][0]
    assert markers["customdata"] == [f"/jobs/{j.pk}/" for j in (prepare, train, evaluate)]
    assert markers["marker"]["color"] == ["#1b8a4a", "#7b8394", "#7b8394"]  # succeeded green, blocked grey
    assert markers["x"] == [0, 1, 2] and len(figure["layout"]["annotations"]) == 2  # two needs, two arrows
    assert "pipeline-status" in client.get(f"/pipelines/{run.pk}/status/").content.decode()
    assert f"/pipelines/{run.pk}/" in client.get("/pipelines/").content.decode()
    job_page = client.get(f"/jobs/{train.pk}/").content.decode()
    assert f'href="/pipelines/{run.pk}/"' in job_page and f'href="/jobs/{prepare.pk}/"' in job_page

    response = client.post(f"/pipelines/{run.pk}/cancel/")
    assert response.status_code == 302
    train.refresh_from_db()
    assert train.state == JobState.CANCELLED

    response = client.post(f"/pipelines/{run.pk}/rerun/", {"from_stage": "train"})
    again = PipelineRun.objects.exclude(pk=run.pk).get()
    assert response["Location"] == f"/pipelines/{again.pk}/"
    assert [s.reused for s in again.ordered_stages()] == [True, False, False]

    client.force_login(outsider)
    for url in (f"/pipelines/{run.pk}/", f"/pipelines/{run.pk}/status/"):
        assert client.get(url).status_code == 404
    assert client.post(f"/pipelines/{run.pk}/cancel/").status_code == 404
    assert client.post(f"/pipelines/{run.pk}/rerun/").status_code == 404
    assert PipelineRun.objects.count() == 2


TWICE = "project: vision\nstages:\n  a: {command: [x]}\n  a: {command: [y]}\n"


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("p.yaml", TWICE, "'a' is given twice (line 3)"),
        ("p.json", '{"project": "vision", "stages": {"a": {}, "a": {}}}', "'a' is given twice"),
        ("p.yaml", "stages: [a, b", "not valid YAML"),
        ("p.yaml", "- a\n- b\n", "a pipeline file holds one mapping"),
    ],
)  # fmt: skip
def test_the_cli_refuses_a_pipeline_file_it_cannot_trust(tmp_path, name, text, message):
    from hangar import cli

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(cli.HangarError, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        cli.load_pipeline_file(str(path))
    assert raised.value.code == cli.EXIT_USAGE


def test_the_cli_reads_a_pipeline_file_and_overrides_its_params(tmp_path):
    from hangar import cli

    path = tmp_path / "pipeline.yaml"
    path.write_text("project: vision\nparams: {EPOCHS: 3}\nstages:\n  train: {command: [python, train.py]}\n")
    document = cli.load_pipeline_file(str(path))
    assert document["stages"] == {"train": {"command": ["python", "train.py"]}} and document["params"] == {"EPOCHS": 3}
    args = cli.parser().parse_args(["pipeline", "rerun", "7", "--from", "evaluate"])
    assert (args.func, args.run, args.from_stage) == (cli.cmd_pipeline_rerun, 7, "evaluate")


def test_a_stages_secrets_reach_its_job_but_not_the_runs_record(owner, project, node, pipeline_root):
    body = document()
    body["stages"]["train"]["secret_env"] = {"WANDB_API_KEY": "s3cret"}
    run = PipelineRun.objects.get(pk=post(owner, body).json()["id"])
    train = run.ordered_stages()[1].job
    assert train.secret_env == {"WANDB_API_KEY": "s3cret"}
    assert "s3cret" not in str(run.document) and run.document["stages"]["train"]["secret_env"] == {
        "WANDB_API_KEY": "********"
    }
    assert "s3cret" not in api_client(owner).get(f"{URL}{run.pk}/").content.decode()


@as_root
def test_sandboxed_stages_of_their_own_uids_share_the_runs_directory(transactional_db, project, owner, settings):
    from django.utils import timezone

    from fleet.models import GPU
    from tests.factories import make_node

    settings.HANGAR_SANDBOX, settings.HANGAR_JOB_UID_RANGE = True, (200000, 299999)
    settings.HANGAR_PIPELINE_ROOT = settings.DATA_DIR / "pipelines-sandboxed"
    node = make_node("node-a", gpus=2)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    stages = {
        "prepare": {"command": shell('echo 1 2 3 > "$HANGAR_PIPELINE_DIR/data"; id -u')},
        "train": {
            "needs": ["prepare"],
            "command": shell('cat "$HANGAR_PIPELINE_DIR/data"; echo w > "$HANGAR_PIPELINE_DIR/m"; id -u'),
        },
    }
    run_ = pipelines.submit_pipeline(owner, {"project": "vision", "stages": stages}).run
    prepare, train = [s.job for s in run_.ordered_stages()]
    try:
        attempt, lines = run_sandboxed(prepare)
        assert attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
        prepared_as = uid_printed(lines)
        train.refresh_from_db()
        assert train.state == JobState.QUEUED
        attempt, lines = run_sandboxed(train)
        assert attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
        assert "1 2 3" in lines
        trained_as = uid_printed(lines)
        directory = Path(run_.directory)
        owners = [(directory / name).stat().st_uid for name in ("data", "m")]
        assert owners == [prepared_as, trained_as] and prepared_as != trained_as  # each its own uid, one directory
    finally:
        shutil.rmtree(settings.HANGAR_PIPELINE_ROOT, ignore_errors=True)


def test_sharing_a_runs_files_never_follows_a_link_out_of_it(tmp_path):
    from agent.pipelinecopy import share_pipeline_files

    outside = tmp_path / "secret"
    outside.write_text("x")
    outside.chmod(0o600)
    run_dir = tmp_path / "run"
    (run_dir / "sub").mkdir(parents=True)
    (run_dir / "sub").chmod(0o700)
    (run_dir / "sub" / "model.ckpt").write_text("w")
    (run_dir / "sub" / "model.ckpt").chmod(0o4700)
    (run_dir / "leak").symlink_to(outside)
    (run_dir / "dirlink").symlink_to(tmp_path)
    stage_uid = 200123 if os.getuid() == 0 else os.getuid()  # as root: the files are a stage uid's
    for path in (run_dir / "sub", run_dir / "sub" / "model.ckpt"):
        mode = path.stat().st_mode & 0o7777
        os.chown(path, stage_uid, stage_uid)
        path.chmod(mode)  # chown drops set-id bits
    os.link(outside, run_dir / "hardlink")  # a file of another uid's (here the test's), linked in

    share_pipeline_files(run_dir, {stage_uid})

    assert (run_dir / "sub").stat().st_mode & 0o7777 == 0o777
    assert (run_dir / "sub" / "model.ckpt").stat().st_mode & 0o7777 == 0o777  # set-uid dropped, x kept for all
    assert outside.stat().st_mode & 0o777 == 0o600 and tmp_path.stat().st_mode & 0o777 != 0o777


def test_an_agent_reads_the_stage_of_a_job_that_runs_one_and_of_no_other(
    owner, project, node, pipeline_root, django_assert_num_queries
):
    """The attempt's load says whether its job runs a stage: a plain job's start reads none."""
    from agent.runner import Runner, attempt_to_run

    body = post(owner, document()).json()
    staged = Job.objects.get(pk=body["stages"][0]["job"])
    plain = make_job(project, owner)
    for job, runs_a_stage in ((staged, True), (plain, False)):
        loaded = attempt_to_run.first(pk=make_attempt(job, node, AttemptState.SCHEDULED).pk)
        assert loaded.runs_a_stage is runs_a_stage
        runner = Runner(loaded)
        with django_assert_num_queries(1 if runs_a_stage else 0):
            stage = pipelines.stage_run_by(runner.job)
        assert (stage is not None and stage.job_id == job.pk) is runs_a_stage
