"""Idempotency keys stay inside what the caller may see now (jobs/submission.py: held_by_key).

Keys are kept per submitting user, so the attacks are by that same user through a narrower
door: (a) their token limited to project X replays the key of their job in project Y;
(b) after leaving project Y they replay their old key; (c) a replay that asks for something
else. (a) and (b) answered with the whole job (env, attempts) or, mismatching, with its id
and which fields differ; now a 409 that names nothing. (c) by someone who sees it keeps the
helpful error. Jobs, pipelines and sweeps alike.
"""

import pytest
from rest_framework.test import APIClient

from jobs import submission, sweeps
from jobs.models import Job, PipelineRun, Sweep
from portal.models import ApiToken, Membership, Role
from tests.factories import make_project, make_user

SECRET_LOOKING = "value-only-project-y-may-read"


def client_for(user, project=None) -> APIClient:
    client = APIClient()
    _, raw = ApiToken.issue(user, "agent", project=project)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def job_body(project: str, **changes) -> dict:
    return {"project": project, "command": ["python", "train.py"], "env": {"NOTE": SECRET_LOOKING}, **changes}


def pipeline_body(project: str, **changes) -> dict:
    stages = {"prepare": {"command": ["python", "prep.py"], "env": {"NOTE": SECRET_LOOKING}}}
    return {"name": "tiny", "project": project, "stages": changes.pop("stages", stages), **changes}


def sweep_body(project: str, **changes) -> dict:
    return {
        "name": "lr",
        "project": project,
        "objective": {"metric": "loss", "mode": "min"},
        "base": {"command": ["python", "train.py"], "env": {"NOTE": SECRET_LOOKING}},
        "grid": {"env.LR": ["0.1"]},
        "idempotency_key": "round-1",
        **changes,
    }


# kind: (url, body, a change that makes a replay mismatch, the model, how the key is sent)
KINDS = {
    "job": ("/api/v1/jobs/", job_body, {"command": ["python", "other.py"]}, Job),
    "pipeline": ("/api/v1/pipelines/", pipeline_body, {"stages": {"prepare": {"command": ["x"]}}}, PipelineRun),
    "sweep": ("/api/v1/sweeps/", sweep_body, {"grid": {"env.LR": ["0.5"]}}, Sweep),
}


def post(client: APIClient, kind: str, project: str, **changes):
    url, body, _, _ = KINDS[kind]
    headers = {} if kind == "sweep" else {"HTTP_IDEMPOTENCY_KEY": "round-1"}  # a sweep's key is in its file
    return client.post(url, body(project, **changes), format="json", **headers)


@pytest.fixture
def world(db, node, settings):
    """Ann is a member of projects x and y; her first submit of each kind is in y."""
    settings.HANGAR_MLFLOW = False
    ann = make_user("ann")
    x = make_project("x", **{Role.MEMBER: ann})
    y = make_project("y", **{Role.MEMBER: ann})
    return ann, x, y


def first_in_y(ann, kind: str) -> int:
    response = post(client_for(ann), kind, "y")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def names_nothing(response, held_id: int) -> None:
    """A 409 whose whole body is the bare refusal: no id, no field compared, nothing of the job."""
    assert response.status_code == 409, response.content
    body = response.json()
    assert body["code"] == "idempotency_conflict"
    assert [(e["field"], e["message"]) for e in body["errors"]] in (
        [("idempotency_key", submission.KEY_TAKEN)],
        [("idempotency_key", sweeps.KEY_TAKEN)],
    ), body
    text = response.content.decode()
    assert SECRET_LOOKING not in text and "train.py" not in text and "prep.py" not in text
    assert str(held_id) not in text
    assert "Idempotent-Replayed" not in response


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_limited_to_another_project_gets_nothing_back(world, kind):
    ann, x, y = world
    held = first_in_y(ann, kind)
    limited = client_for(ann, project=x)

    same = post(limited, kind, "y")  # (a) the very same submit, through a token for project x
    names_nothing(same, held)
    aimed = post(limited, kind, "x")  # (a) and (c): the key replayed for the token's own project
    names_nothing(aimed, held)
    assert KINDS[kind][3].objects.count() == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_member_who_left_the_project_gets_nothing_back(world, kind):
    ann, x, y = world
    held = first_in_y(ann, kind)
    same_token = client_for(ann)
    assert post(same_token, kind, "y").status_code == 200  # the setup: a member's replay is answered
    Membership.objects.filter(user=ann, project=y).delete()

    names_nothing(post(same_token, kind, "y"), held)  # (b)
    names_nothing(post(same_token, kind, "x"), held)
    assert KINDS[kind][3].objects.count() == 1


@pytest.mark.parametrize("kind", KINDS)
def test_who_sees_it_gets_it_back_or_the_helpful_error(world, kind):
    ann, x, y = world
    held = first_in_y(ann, kind)
    client = client_for(ann)

    again = post(client, kind, "y")
    assert again.status_code == 200 and again["Idempotent-Replayed"] == "true" and again.json()["id"] == held
    _, _, change, model = KINDS[kind]
    other = post(client, kind, "y", **change)  # (c)
    assert other.status_code == 409 and other.json()["code"] == "idempotency_conflict"
    assert str(held) in other.json()["message"] and "new key" in other.json()["message"]
    assert model.objects.count() == 1


def test_a_viewer_of_the_project_still_gets_their_own_job_back(world):
    """Seeing is what counts: a member made viewer sees the job, so the replay returns it."""
    ann, x, y = world
    held = first_in_y(ann, "job")
    Membership.objects.filter(user=ann, project=y).update(role=Role.VIEWER)
    again = post(client_for(ann), "job", "y")
    assert again.status_code == 200 and again.json()["id"] == held


def test_another_users_key_is_theirs_alone(world):
    """Keys are per user: the same key by a teammate makes the teammate's own job."""
    ann, x, y = world
    held = first_in_y(ann, "job")
    bob = make_user("bob")
    Membership.objects.create(user=bob, project=y, role=Role.MEMBER)
    response = post(client_for(bob), "job", "y")
    assert response.status_code == 201 and response.json()["id"] != held
