"""Property-based requests generated from the OpenAPI schema (schemathesis), in-process:
whatever an agent sends, the API answers with no 5xx. Bounded examples per operation."""

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings

from portal.models import Role, Volume
from tests.factories import make_job, make_node, make_project, make_user, token_client

schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application())


@pytest.fixture(autouse=True)
def keep_the_test_connection():
    """Requests go straight to the WSGI handler, whose request signals would close the
    test's database connection (mid-transaction) after each one; Django's test client
    disconnects them the same way."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def auth(db):
    user = make_user("fuzzer")
    project = make_project("lab", **{Role.ADMIN: user})
    make_node()
    make_job(project, user)
    Volume.objects.create(project=project, name="data", path="/data")
    client = token_client(user)
    return client._credentials["HTTP_AUTHORIZATION"]


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_request_makes_the_api_fail(case, auth):
    response = case.call(headers={"Authorization": auth})
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:500]}"
    )
    if response.status_code >= 400 and response.headers.get("Content-Type", "").startswith("application/json"):
        assert set(response.json()) == {"code", "message", "errors"}, response.text
