"""Submitting a job: what the API and the browser form accept, and how they refuse the rest."""

import pytest

from jobs.models import Job, JobEvent, JobState
from portal.models import Membership, Role
from tests.factories import api_client, make_node, make_user

URL = "/api/v1/jobs/"


@pytest.fixture
def submit(owner, project, other_project, node):
    """POST a submission as the owner, with a valid body unless told otherwise."""
    client = api_client(owner)

    def post(**fields):
        body = {"project": "vision", "command": ["python", "train.py"], **fields}
        body = {key: value for key, value in body.items() if value is not MISSING}
        return client.post(URL, body, format="json")

    return post


MISSING = object()


def assert_refused(response, field: str, *fragments: str) -> str:
    """A 400 in the API's error shape naming `field`, whose message says how to fix it; no job made."""
    assert response.status_code == 400, response.content
    body = response.json()
    assert set(body) == {"code", "message", "errors"}
    messages = {error["field"]: error["message"] for error in body["errors"]}
    assert field in messages, body
    for fragment in fragments:
        assert fragment in messages[field], messages[field]
    assert body["message"].startswith(f"{field}: ") or field == ""
    assert not Job.objects.exists()
    return messages[field]


def test_it_creates_a_queued_job_with_a_submitted_event(submit, owner):
    response = submit(name="resnet", gpus_per_node=2, env={"SEED": "7"})

    assert response.status_code == 201, response.content
    job = Job.objects.get()
    body = response.json()
    assert body["id"] == job.pk
    assert body["state"] == JobState.QUEUED == job.state
    assert job.command == ["python", "train.py"]
    assert job.gpus_per_node == 2
    assert job.env == {"SEED": "7"}
    assert job.submitted_by == owner
    assert body["urls"]["logs_ws"] == f"/ws/jobs/{job.pk}/logs/"
    assert list(JobEvent.objects.filter(job=job).values_list("kind", flat=True)) == ["submitted"]


def test_it_names_the_job_after_the_program_and_applies_the_default_runtime(submit, settings):
    response = submit(command=["/usr/bin/python3", "x.py"])

    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert job.name == "python3"
    assert job.max_runtime_seconds == settings.HANGAR_DEFAULT_MAX_RUNTIME_SECONDS


def test_it_refuses_an_empty_command(submit):
    assert_refused(submit(command=[]), "command", "must not be empty", '["python", "train.py"')


def test_it_refuses_a_command_given_as_a_string(submit):
    response = submit(command="python train.py")
    assert_refused(response, "command", "must be a list of strings (argv), not a string", "never")


def test_it_refuses_a_missing_command(submit):
    assert_refused(submit(command=MISSING), "command", "is required", '["python", "train.py"')


def test_it_refuses_an_unknown_project_and_lists_the_users_projects(submit):
    assert_refused(submit(project="nope"), "project", "no project 'nope'", "your projects: vision")


def test_it_refuses_a_project_the_user_is_not_a_member_of(submit):
    # "nlp" exists, but only the outsider belongs to it.
    assert_refused(submit(project="nlp"), "project", "no project 'nlp'", "your projects: vision")


def test_it_refuses_more_gpus_than_the_largest_node_has(submit):
    assert_refused(
        submit(gpus_per_node=16), "gpus_per_node", "gpus_per_node=16 but the largest node has 4; ask for at most 4"
    )


def test_it_refuses_more_gpus_than_the_largest_node_of_the_type_has(submit):
    make_node("node-b", gpus=2, model="A100")

    assert_refused(
        submit(gpus_per_node=4, gpu_type="A100"),
        "gpus_per_node",
        "gpus_per_node=4 but the largest A100 node has 2; ask for at most 2",
    )


def test_it_refuses_zero_gpus(submit):
    assert_refused(submit(gpus_per_node=0), "gpus_per_node", "must be at least 1")


def test_it_refuses_a_negative_runtime(submit):
    assert_refused(submit(max_runtime_seconds=-5), "max_runtime_seconds", "positive number of seconds", "3600")


def test_it_refuses_a_body_that_is_not_json(owner, project, node):
    response = api_client(owner).post(URL, data=b"{not json", content_type="application/json")

    assert_refused(response, "body", "not valid JSON", "Content-Type: application/json")
    assert response.json()["code"] == "parse_error"


def test_it_refuses_an_unknown_field(submit):
    assert_refused(submit(gpu=2), "gpu", "is not a job field", "gpus_per_node")


@pytest.mark.parametrize("key", ["CUDA_VISIBLE_DEVICES", "HANGAR_X"])
def test_it_refuses_env_variables_hangar_sets(submit, key):
    assert_refused(submit(env={key: "0"}), "env", f"{key} is set by Hangar", "remove it from env")


@pytest.mark.parametrize("key", ["1ABC", "MY-VAR", "A B", ""])
def test_it_refuses_invalid_env_names(submit, key):
    assert_refused(submit(env={key: "x"}), "env", "is not a valid variable name", "letters, digits and '_'")


def test_it_refuses_an_unknown_gpu_type(submit):
    assert_refused(submit(gpu_type="Z9"), "gpu_type", "no node has Z9 GPUs", "GPU types: H100")


def test_it_refuses_an_unknown_priority(submit):
    assert_refused(submit(priority="asap"), "priority", "asap is not a priority class", "normal")


def test_it_refuses_more_nodes_than_the_fleet_has(submit):
    assert_refused(submit(nodes=2, gpus_per_node=4), "nodes", "nodes=2 but only 1", "ask for fewer")


def test_a_viewer_cannot_submit(project, node):
    viewer = make_user("viewer")
    Membership.objects.create(project=project, user=viewer, role=Role.VIEWER)

    response = api_client(viewer).post(URL, {"project": "vision", "command": ["true"]}, format="json")

    assert_refused(response, "project", "no project 'vision' that you can submit to", "your projects: none")


# --- The browser form ------------------------------------------------------


def form_data(**fields) -> dict:
    return {
        "project": "vision",
        "command": "python train.py",
        "gpus_per_node": "1",
        "gpu_type": "",
        "priority": "normal",
        "max_runtime_seconds": "3600",
        "env": "",
        **fields,
    }


@pytest.fixture
def browser(client, owner, project, node):
    client.force_login(owner)
    return client


def test_the_form_splits_the_command_like_a_shell_and_shows_the_job(browser, owner):
    response = browser.post("/jobs/new/", form_data(command='python -c "print(1)"', env="SEED=7\n\nMODE=a=b"))

    job = Job.objects.get()
    assert response.status_code == 302
    assert response["Location"] == f"/jobs/{job.pk}/"
    assert job.command == ["python", "-c", "print(1)"]
    assert job.env == {"SEED": "7", "MODE": "a=b"}
    assert job.submitted_by == owner
    assert job.state == JobState.QUEUED


def test_the_form_refuses_an_empty_command(browser):
    response = browser.post("/jobs/new/", form_data(command=""))

    assert response.status_code == 200
    assert "This field is required." in response.content.decode()
    assert not Job.objects.exists()


def test_the_form_shows_the_api_error_for_too_many_gpus(browser):
    response = browser.post("/jobs/new/", form_data(gpus_per_node="16"))

    assert response.status_code == 200
    assert "gpus_per_node=16 but the largest node has 4; ask for at most 4" in response.content.decode()
    assert response.context["form"].errors["gpus_per_node"]
    assert not Job.objects.exists()


def test_the_form_refuses_unbalanced_quotes(browser):
    response = browser.post("/jobs/new/", form_data(command='python -c "print(1)'))

    assert response.status_code == 200
    assert "check the quotes" in response.content.decode()
    assert not Job.objects.exists()


def test_the_form_shows_the_api_error_for_a_reserved_env_variable(browser):
    response = browser.post("/jobs/new/", form_data(env="CUDA_VISIBLE_DEVICES=0"))

    assert response.status_code == 200
    assert "CUDA_VISIBLE_DEVICES is set by Hangar for each attempt" in response.content.decode()
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("fields", "field", "fragment"),
    [
        ({"command": [1, 2]}, "command[0]", "must be a string (in double quotes); got a number"),
        ({"command": ["python", True]}, "command[1]", "got a boolean"),
        ({"env": {"A": 1}}, "env.A", "must be a string (in double quotes); got a number"),
        ({"secret_env": {"TOKEN": None}}, "secret_env.TOKEN", "must be a string"),
        ({"env": ["A=1"]}, "env", 'must be an object of NAME: "value" pairs'),
        ({"name": {"x": 1}}, "name", "got an object"),
    ],
)
def test_it_refuses_values_that_are_not_strings_naming_the_item(submit, fields, field, fragment):
    assert_refused(submit(**fields), field, fragment)


def test_it_says_what_to_send_when_the_body_is_not_an_object(owner, project, node):
    response = api_client(owner).post(URL, [{"project": "vision"}], format="json")

    assert response.status_code == 400
    assert "the body must be a JSON object of job fields" in response.json()["message"]
    assert "got list" in response.json()["message"]
    assert not Job.objects.exists()


def test_cancelling_a_job_that_ended_is_a_conflict_that_says_how_it_ended(owner, project, node):
    job = Job.objects.create(
        project=project, submitted_by=owner, name="done", command=["true"], max_runtime_seconds=60,
        state=JobState.SUCCEEDED, exit_code=0,
    )  # fmt: skip

    response = api_client(owner).post(f"/api/v1/jobs/{job.pk}/cancel/")

    assert response.status_code == 409
    assert response.json()["code"] == "already_ended"
    assert response.json()["message"] == f"job {job.pk} already ended (succeeded, exit 0); there is nothing to cancel"
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED


def test_the_form_submits_a_job_that_waits_for_others_and_names_a_bad_one(browser, owner, project):
    first = Job.objects.create(
        project=project, submitted_by=owner, name="prep", command=["true"], max_runtime_seconds=60
    )

    response = browser.post("/jobs/new/", form_data(depends_on=f"{first.pk}"))
    job = Job.objects.exclude(pk=first.pk).get()
    assert response.status_code == 302 and job.state == JobState.BLOCKED
    assert job.depends_on == [{"job": first.pk, "on": "succeeded"}]

    response = browser.post("/jobs/new/", form_data(depends_on="999999:finished"))
    assert response.status_code == 200
    assert "depends_on[0].job: no job 999999 that you can see" in response.content.decode()
