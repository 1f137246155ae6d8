"""Property-based requests generated from the OpenAPI schema (schemathesis), in-process:
whatever an agent sends, the API answers with no 5xx. Bounded examples per operation."""

import pytest
import schemathesis
from django.core import signals
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.config._checks import POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES as ACCEPTED

from fleet import models as fleet
from portal.models import Role, Volume
from tests.factories import make_attempt, make_job, make_node, make_project, make_user, token_client

# A change is checked against stored state the schema cannot describe (the project a job or
# token names must be one of yours, a node must be ready to cordon, a job queued to move):
# there a schema-valid body may be refused with a 400 naming the field. Reads may not.
CONFIG = SchemathesisConfig.from_dict(
    {
        "operations": [
            {
                "include-method": ["POST", "PUT", "PATCH", "DELETE"],
                "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTED, "400"]}},
            }
        ]
    }
)
schema = schemathesis.openapi.from_wsgi("/api/schema/?format=json", get_wsgi_application(), config=CONFIG)


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
    node = make_node()
    job = make_job(project, user)
    attempt = make_attempt(job, node, "failed")
    # Rows for every list: responses are checked against their schemas (a health event and
    # check of the job, so their nullable and hidden fields are exercised too).
    fleet.HealthEvent.objects.create(node=node, attempt=attempt, kind="xid", severity="critical", message="Xid 79")
    fleet.HealthCheck.objects.create(node=node, attempt=attempt, name="devices", passed=True, duration_ms=1.0)
    Volume.objects.create(project=project, name="data", path="/data")
    client = token_client(user)
    return client._credentials["HTTP_AUTHORIZATION"]


ALL_CHECKS = None  # filled on first use: every check schemathesis registers


def all_checks() -> list:
    global ALL_CHECKS
    if ALL_CHECKS is None:
        from schemathesis.checks import CHECKS, load_all_checks

        load_all_checks()
        ALL_CHECKS = list(CHECKS.get_all())
    return ALL_CHECKS


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_request_makes_the_api_fail(case, auth):
    """Every check schemathesis has: no 5xx, every status code, content type, header and body
    as the schema declares them, schema-invalid requests refused, valid ones accepted."""
    response = case.call_and_validate(headers={"Authorization": auth}, checks=all_checks())
    if response.status_code >= 400 and response.headers.get("Content-Type", "").startswith("application/json"):
        assert set(response.json()) <= {"code", "message", "errors", "request_id"}, response.text
