"""What a submit refuses for the sandbox's sake (jobs/jobspec.py, portal/volumes.py): reserved
variable names, volume paths outside the rules, and another user's secrets on a resubmit."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client

from jobs.jobspec import env_problem, reserved_reason, secrets_to_give
from jobs.models import Environment, EnvironmentKind, Job
from portal.models import Volume
from portal.settings import BASE_DIR
from portal.volumes import clean_volume_path
from tests.factories import api_client, make_node

SUBMIT = {"project": "lab", "command": ["python", "train.py"]}


@pytest.fixture
def gpus(db):
    return make_node()


def submit(client, **fields):
    return client.post("/api/v1/jobs/", {**SUBMIT, **fields}, format="json")


def messages(response) -> dict[str, str]:
    assert response.status_code == 400, response.content
    return {error["field"]: error["message"] for error in response.json()["errors"]}


# --- reserved names ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, container, fragment",
    [
        ("MLFLOW_RUN_ID", False, "its own MLflow run"),
        ("MLFLOW_TRACKING_URI", False, "its own MLflow run"),
        ("HANGAR_JOB_ID", False, "set by Hangar"),
        ("CUDA_VISIBLE_DEVICES", False, "set by Hangar"),
        ("NVIDIA_VISIBLE_DEVICES", False, "GPUs a container sees"),
        ("LD_PRELOAD", False, "load a library"),
        ("LD_LIBRARY_PATH", False, "libraries"),
        ("LD_AUDIT", False, "as root before the job's own uid"),
        ("GCONV_PATH", False, "as root before the job's own uid"),
        ("GLIBC_TUNABLES", False, "as root before the job's own uid"),
        ("DOCKER_HOST", False, "docker engine"),
        ("PATH", True, "container job"),
    ],
)
def test_reserved_names_say_why(name, container, fragment):
    assert fragment in reserved_reason(name, container)


@pytest.mark.parametrize("name", ["PATH", "SEED", "WANDB_API_KEY", "MLFLOW", "LD_DEBUG_X"])
def test_ordinary_names_of_a_host_job_are_free(name):
    assert reserved_reason(name) is None


@pytest.mark.parametrize("field", ["env", "secret_env"])
@pytest.mark.parametrize(
    "name", ["MLFLOW_RUN_ID", "LD_PRELOAD", "LD_AUDIT", "MALLOC_TRACE", "DOCKER_HOST", "NVIDIA_VISIBLE_DEVICES"]
)
def test_the_api_refuses_a_reserved_name_naming_it(roles, gpus, field, name):
    errors = messages(submit(api_client(roles["member"]), **{field: {name: "x"}}))

    assert errors[field].startswith(f"{name} ") and "remove it from env" in errors[field]
    assert not Job.objects.exists()


def test_path_is_refused_for_a_container_job_only(roles, gpus):
    Environment.objects.create(name="pt", kind=EnvironmentKind.CONTAINER, image="pytorch:latest", everywhere=True)
    client = api_client(roles["member"])

    errors = messages(submit(client, environment="pt", env={"PATH": "/tmp/evil"}))

    assert "PATH would choose the programs the agent runs for a container job" in errors["env"]
    assert submit(client, env={"PATH": "/opt/bin:/usr/bin"}).status_code == 201


def test_the_form_shows_why_a_name_is_reserved(roles, gpus):
    browser = Client()
    browser.force_login(roles["member"])
    form = {"project": "lab", "command": "python t.py", "gpus_per_node": 1, "max_runtime_seconds": 60}

    response = browser.post("/jobs/new/", {**form, "env": "LD_PRELOAD=/tmp/x.so"})

    assert "LD_PRELOAD would load a library" in response.content.decode()
    assert not Job.objects.exists()


def test_env_problem_names_the_first_reserved_variable():
    assert env_problem(["SEED", "MLFLOW_RUN_ID"]).startswith("MLFLOW_RUN_ID is set by Hangar")
    assert env_problem(["SEED", "PATH"]) is None and env_problem(["PATH"], container=True).startswith("PATH ")


# --- volume paths ------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, roots, expected",
    [
        ("/data/imagenet", [], "/data/imagenet"),
        ("/data//imagenet/", [], "/data/imagenet"),
        ("//data/./imagenet", ["/data"], "/data/imagenet"),
        ("/data", ["/data"], "/data"),
        ("/data/imagenet", ["/data", "/scratch"], "/data/imagenet"),
    ],
)
def test_volume_paths_are_normalised(path, roots, expected):
    assert clean_volume_path(path, roots) == expected


@pytest.mark.parametrize(
    "path, roots, fragment",
    [
        ("data/imagenet", [], "is relative"),
        ("/data/../../etc/shadow", [], "contains '..'"),
        ("/data/..", ["/data"], "contains '..'"),
        ("/", [], "whole file system"),
        ("/etc/shadow", ["/data"], "outside the volume roots"),
        ("/database", ["/data"], "outside the volume roots"),
    ],
)
def test_volume_paths_outside_the_rules_are_refused(path, roots, fragment):
    with pytest.raises(ValueError, match=fragment):
        clean_volume_path(path, roots)


def test_registering_a_volume_outside_the_roots_is_refused(roles, settings):
    settings.HANGAR_VOLUME_ROOTS = ["/data"]
    admin = api_client(roles["admin"])
    url = "/api/v1/projects/lab/volumes/"

    bad = admin.post(url, {"name": "x", "path": "/data/../../etc/shadow"}, format="json")
    outside = admin.post(url, {"name": "y", "path": "/etc"}, format="json")
    good = admin.post(url, {"name": "z", "path": "/data//imagenet/"}, format="json")

    assert "contains '..'" in messages(bad)["path"] and "outside the volume roots" in messages(outside)["path"]
    assert good.status_code == 201 and Volume.objects.get().path == "/data/imagenet"


def test_a_job_cannot_mount_a_volume_registered_before_the_rules(roles, gpus, settings):
    Volume.objects.create(project=roles["lab"], name="old", path="/data/../etc")  # registered by an older Hangar

    errors = messages(submit(api_client(roles["member"]), volumes=[{"name": "old"}]))

    assert "volume old cannot be mounted" in errors["volumes[0].name"] and "contains '..'" in errors["volumes[0].name"]


# --- resubmit and run again ------------------------------------------------------------


def test_secrets_to_give():
    assert secrets_to_give({"A": "1"}, 1, 1, {}) == []
    assert secrets_to_give({"A": "1", "B": "2"}, 1, 2, {"B": "x"}) == ["A"]
    assert secrets_to_give({"A": "1"}, 1, 2, {"A": "mine"}) == []


def test_resubmit_by_another_user_is_refused_until_the_secrets_are_given(roles, gpus):
    first = submit(api_client(roles["manager"]), secret_env={"API_TOKEN": "managers-token"}, name="run").json()
    member = api_client(roles["member"])
    url = f"/api/v1/jobs/{first['id']}/resubmit/"

    refused = member.post(url, {}, format="json")
    given = member.post(url, {"secret_env": {"API_TOKEN": "members-own"}}, format="json")

    message = messages(refused)["secret_env"]
    assert "its secrets are not copied" in message and "API_TOKEN" in message and "managers-token" not in message
    assert given.status_code == 201, given.content
    assert Job.objects.get(pk=given.json()["id"]).secret_env == {"API_TOKEN": "members-own"}
    assert Job.objects.count() == 2


def test_resubmit_by_the_submitter_keeps_the_secrets(roles, gpus):
    client = api_client(roles["member"])
    first = submit(client, secret_env={"API_TOKEN": "mine"}).json()

    again = client.post(f"/api/v1/jobs/{first['id']}/resubmit/")

    assert again.status_code == 201 and Job.objects.get(pk=again.json()["id"]).secret_env == {"API_TOKEN": "mine"}


def test_run_again_by_another_user_says_which_secrets_to_give(roles, gpus):
    first = submit(api_client(roles["manager"]), secret_env={"API_TOKEN": "managers-token"}).json()
    browser = Client()
    browser.force_login(roles["member"])

    response = browser.post(f"/jobs/{first['id']}/run-again/", follow=True)

    page = response.content.decode()
    assert "its secrets are not copied" in page and "API_TOKEN" in page and "managers-token" not in page
    assert Job.objects.count() == 1


# --- Hangar's own files -----------------------------------------------------------------


def settings_load(data_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HANGAR_DATA_DIR": str(data_dir), "DJANGO_SETTINGS_MODULE": "portal.settings"}
    env.pop("HANGAR_SECRET_KEY", None)
    code = "import django; django.setup(); from django.conf import settings; print(len(settings.SECRET_KEY))"
    return subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, env=env, capture_output=True, text=True)


def test_a_fresh_data_directory_and_its_secret_key_are_private(tmp_path):
    data_dir = tmp_path / "var"

    done = settings_load(data_dir)

    assert done.returncode == 0, done.stderr
    assert data_dir.stat().st_mode & 0o777 == 0o700
    assert (data_dir / "secret_key").stat().st_mode & 0o777 == 0o600
    assert all(p.stat().st_mode & 0o077 == 0 for p in data_dir.iterdir() if p.is_file())


def test_a_world_readable_secret_key_is_refused_saying_how_to_fix_it(tmp_path):
    key = tmp_path / "secret_key"
    key.write_text("k" * 50)
    key.chmod(0o644)

    done = settings_load(tmp_path)

    assert done.returncode != 0
    assert "readable by other users (mode 0644)" in done.stderr and f"chmod 600 {key}" in done.stderr


def test_a_multi_node_job_is_refused_where_the_project_has_no_network(roles, gpus):
    make_node("node-b")
    roles["lab"].network = "none"
    roles["lab"].save(update_fields=["network"])

    errors = messages(submit(api_client(roles["member"]), nodes=2))

    assert "network policy is none (loopback only)" in errors["nodes"]


def test_a_container_image_outside_the_projects_allow_list_is_refused(roles, gpus):
    for name, image in (("pt", "docker.io/evil/miner"), ("ngc", "nvcr.io/nvidia/pytorch:25.01-py3")):
        Environment.objects.create(name=name, kind=EnvironmentKind.CONTAINER, image=image, everywhere=True)
    roles["lab"].allowed_images = "nvcr.io/nvidia/*\n"
    roles["lab"].save(update_fields=["allowed_images"])
    client = api_client(roles["member"])

    errors = messages(submit(client, environment="pt"))

    expected = "image docker.io/evil/miner is not among project lab's allowed images (nvcr.io/nvidia/*)"
    assert expected in errors["environment"]
    assert submit(client, environment="ngc").status_code == 201


def test_a_projects_network_policy_shows_in_the_api_and_is_not_changed_through_it(roles):
    client = api_client(roles["admin"])

    assert client.get("/api/v1/projects/lab/").json()["network"] == "host"
    assert client.patch("/api/v1/projects/lab/", {"network": "none"}, format="json").status_code == 405
