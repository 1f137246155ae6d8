"""Bad input is a 400 naming the field, never a 500 (portal/inputs.py); and a 500 that
does happen is logged under the request id its body carries (portal/requestid.py)."""

import json
import logging

import pytest

from jobs.api import views as job_views
from tests.factories import api_client, make_job


def field_of(response) -> str:
    assert response.status_code == 400, (response.status_code, response.content[:300])
    return response.json()["errors"][0]["field"]


@pytest.mark.django_db
def test_json_nested_100000_deep_is_a_400(owner, project):
    body = "[" * 100_000 + "]" * 100_000
    response = api_client(owner).generic("POST", "/api/v1/jobs/", body, "application/json")
    assert field_of(response) == "body"
    assert "nests deeper" in response.json()["message"]


@pytest.mark.django_db
def test_json_nested_past_the_depth_limit_names_where(owner, project):
    deep: list = ["deep"]
    for _ in range(40):
        deep = [deep]
    body = {"name": "x", "env": {"A": deep}}
    response = api_client(owner).post("/api/v1/jobs/", body, format="json")
    assert field_of(response).startswith("env.A")


@pytest.mark.django_db
@pytest.mark.parametrize(
    "body, field",
    [
        ('{"name": "a\\u0000b", "project": "vision", "command": ["x"]}', "name"),
        ('{"name": "ok", "project": "vision", "command": ["x"], "idempotency_key": "k\\u0000"}', "idempotency_key"),
        ('{"name": "\\ud800", "project": "vision", "command": ["x"]}', "name"),
        ('{"name": "ok", "project": "vision", "command": ["x", "\\udfff"]}', "command[1]"),
        ('{"name": "ok", "project": "vision", "command": ["x"], "gpus_per_node": 1e309}', "gpus_per_node"),
        ('{"name": "ok", "project": "vision", "command": [], "gpus_per_node": 9999999999999999999}', "gpus_per_node"),
    ],
)
def test_nul_surrogates_and_huge_numbers_in_json_name_the_field(owner, project, body, field):
    response = api_client(owner).generic("POST", "/api/v1/jobs/", body, "application/json")
    assert field_of(response) == field


@pytest.mark.django_db
@pytest.mark.parametrize("param", ["name", "project", "submitted_by", "state"])
def test_a_nul_in_a_job_filter_is_a_400(owner, project, param):
    assert field_of(api_client(owner).get("/api/v1/jobs/", {param: "a\x00b"})) == param


@pytest.mark.django_db
@pytest.mark.parametrize(
    "params, field",
    [
        ({"q": "a\x00"}, "q"),
        ({"node": "\x00"}, "node"),
        ({"last_minutes": "1e309"}, "last_minutes"),
        ({"last_minutes": "nan"}, "last_minutes"),
        ({"last_minutes": "1e300"}, "last_minutes"),
        ({"limit": "100000000000000000000"}, "limit"),
        ({"after_seq": "1e20"}, "after_seq"),
    ],
)
def test_bad_log_parameters_are_a_400(owner, project, params, field):
    job = make_job(project, owner)
    assert field_of(api_client(owner).get(f"/api/v1/jobs/{job.pk}/logs/", params)) == field


@pytest.mark.django_db
@pytest.mark.parametrize("params, field", [({"limit": "1" + "0" * 20}, "limit"), ({"offset": "1e20"}, "offset")])
def test_bad_page_parameters_are_a_400(owner, project, params, field):
    assert field_of(api_client(owner).get("/api/v1/jobs/", params)) == field


@pytest.mark.django_db
def test_a_huge_limit_is_read_as_the_largest_page(owner, project):
    assert api_client(owner).get("/api/v1/jobs/", {"limit": "5000000"}).status_code == 200


@pytest.mark.django_db
def test_a_nul_in_a_node_name_of_the_path_is_a_400(owner):
    assert field_of(api_client(owner).get("/api/v1/nodes/a%00b/")) == "path"


@pytest.mark.django_db
def test_a_crash_is_logged_under_the_request_id_its_body_carries(owner, project, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("the bug")

    monkeypatch.setattr(job_views, "queue_state", broken)
    client = api_client(owner)
    client.raise_request_exception = False
    with caplog.at_level(logging.ERROR, logger="hangar.web"):
        response = client.get("/api/v1/queue/")
    assert response.status_code == 500
    body = json.loads(response.content)
    request_id = body["request_id"]
    assert response["X-Request-Id"] == request_id and request_id in body["message"]
    assert int(response["Content-Length"]) == len(response.content)
    crash = [r for r in caplog.records if request_id in r.getMessage() and r.exc_info]
    assert crash and "the bug" in str(crash[0].exc_info[1])
