"""Every API error has one JSON shape; the schema and its docs pages are served offline."""

import os

import pytest
from django.core.cache import cache

from tests.factories import api_client, make_job

SHAPE = {"code", "message", "errors"}


def assert_error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == SHAPE
    assert body["message"] and all(set(e) == {"field", "message"} for e in body["errors"])
    if code:
        assert body["code"] == code
    return body


def test_validation_errors_name_the_field_problem_and_fix(owner, project, node):
    response = api_client(owner).post(
        "/api/v1/jobs/", {"project": "vision", "command": ["python"], "gpus_per_node": 16}, format="json"
    )
    body = assert_error(response, 400, "invalid")
    assert body["errors"] == [
        {"field": "gpus_per_node", "message": "gpus_per_node=16 but the largest node has 4; ask for at most 4"}
    ]
    assert body["message"].startswith("gpus_per_node: ")


def test_nested_field_errors_carry_their_path(owner, project, node):
    response = api_client(owner).post(
        "/api/v1/jobs/",
        {"project": "vision", "command": ["x"], "volumes": [{"name": "data", "mode": "rx"}]},
        format="json",
    )
    body = assert_error(response, 400, "invalid")
    assert body["errors"][0]["field"] == "volumes[0].mode"
    assert "use ro (read-only) or rw" in body["message"]


def test_unauthenticated_forbidden_not_found_and_method_errors_share_the_shape(owner, teammate, outsider, project):
    job = make_job(project, owner)
    assert_error(api_client().get("/api/v1/jobs/"), 401, "not_authenticated")
    assert_error(api_client(teammate).post(f"/api/v1/jobs/{job.pk}/cancel/"), 403, "permission_denied")
    assert_error(api_client(outsider).get(f"/api/v1/jobs/{job.pk}/"), 404, "not_found")
    assert_error(api_client(owner).delete(f"/api/v1/jobs/{job.pk}/"), 405, "method_not_allowed")


def test_an_unknown_api_url_answers_json_404(owner):
    body = assert_error(api_client(owner).get("/api/v1/no-such-thing/"), 404, "not_found")
    assert "/api/docs/" in body["message"]


def test_bad_json_and_wrong_content_type_say_what_to_send(owner, project):
    client = api_client(owner)
    body = assert_error(client.post("/api/v1/jobs/", "{not json", content_type="application/json"), 400, "parse_error")
    assert "Content-Type: application/json" in body["message"]
    assert_error(client.post("/api/v1/jobs/", "a=b", content_type="text/plain"), 415)


def test_a_bad_filter_value_is_an_invalid_error(owner, project):
    body = assert_error(api_client(owner).get("/api/v1/jobs/?state=sleeping"), 400, "invalid")
    assert body["errors"][0]["field"] == "state" and "queued" in body["message"]


@pytest.fixture
def tight_rate(settings):
    from rest_framework.settings import api_settings
    from rest_framework.throttling import SimpleRateThrottle

    rates = {"token": "3/min"}
    SimpleRateThrottle.THROTTLE_RATES = rates
    cache.clear()
    yield
    SimpleRateThrottle.THROTTLE_RATES = api_settings.DEFAULT_THROTTLE_RATES
    cache.clear()


def test_rate_limit_is_per_token_with_retry_after(owner, tight_rate, project):
    first, second = api_client(owner), api_client(owner)
    for _ in range(3):
        assert first.get("/api/v1/jobs/").status_code == 200

    response = first.get("/api/v1/jobs/")

    body = assert_error(response, 429, "throttled")
    assert int(response["Retry-After"]) >= 1
    assert "retry after" in body["message"]
    assert second.get("/api/v1/jobs/").status_code == 200


def test_the_schema_lists_every_api_area(client, db):
    response = client.get("/api/schema/?format=json")

    assert response.status_code == 200
    paths = response.json()["paths"]
    for expected in ("/api/v1/jobs/", "/api/v1/jobs/{id}/resubmit/", "/api/v1/nodes/", "/api/v1/tokens/"):
        assert expected in paths
    assert "apiToken" in response.json()["components"]["securitySchemes"]


@pytest.mark.parametrize("url", ["/api/docs/", "/api/redoc/"])
def test_the_docs_pages_load_their_assets_from_this_server(client, db, url):
    page = client.get(url).content.decode()

    assert "/static/drf_spectacular_sidecar/" in page
    assert "cdn." not in page and "https://" not in page.split("<body", 1)[-1].split("</body>")[0].replace(
        "https://swagger.io", ""
    )


@pytest.fixture
def shared_counts(settings, tight_rate):
    """The rate limit counted in the local Redis under a key prefix of this test's own."""
    import uuid

    import redis

    url = os.environ.get("HANGAR_TEST_REDIS_URL", "redis://127.0.0.1:6379/5")
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis at {url} is unreachable: {exc}")
    settings.REDIS_URL, settings.REDIS_PREFIX = url, f"hangar_test_{uuid.uuid4().hex[:10]}"
    client = redis.Redis.from_url(url)
    yield client
    for key in client.scan_iter(f"{settings.REDIS_PREFIX}:*"):
        client.delete(key)


def test_with_redis_the_rate_limit_is_counted_there_for_every_web_worker(owner, project, shared_counts, settings):
    client = api_client(owner)
    for _ in range(3):
        assert client.get("/api/v1/jobs/").status_code == 200
    cache.clear()  # another worker's memory: only Redis remembers the three requests

    response = client.get("/api/v1/jobs/")

    assert_error(response, 429, "throttled")
    assert 1 <= int(response["Retry-After"]) <= 60
    assert list(shared_counts.scan_iter(f"{settings.REDIS_PREFIX}:throttle_token_*"))
