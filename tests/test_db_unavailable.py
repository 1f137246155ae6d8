"""While the database is down every request answers 503 with Retry-After: the API in its
JSON error shape, pages with a plain page; never a 500 with a traceback. The drill that
stops a real PostgreSQL is tests/test_drills_services.py (drill 3)."""

import json

import pytest
from django.db import InterfaceError, OperationalError
from django.test import RequestFactory

from portal.api.errors import crashed
from portal.middleware import DatabaseUnavailableMiddleware

DOWN = OperationalError('connection failed: connection to server at "127.0.0.1", port 5432 failed: Connection refused')


def answer(path: str, exc: Exception):
    middleware = DatabaseUnavailableMiddleware(lambda request: None)
    return middleware.process_exception(RequestFactory().get(path), exc)


def test_the_api_answers_503_in_its_error_shape_with_retry_after():
    response = answer("/api/v1/jobs/", DOWN)
    assert response.status_code == 503
    assert int(response["Retry-After"]) > 0
    body = json.loads(response.content)
    assert set(body) == {"code", "message", "errors"} and body["code"] == "unavailable"


@pytest.mark.parametrize("exc", [DOWN, InterfaceError("connection already closed")])
def test_a_page_answers_a_plain_503_page(exc):
    response = answer("/jobs/", exc)
    assert response.status_code == 503 and response["Content-Type"].startswith("text/html")
    assert b"briefly unavailable" in response.content and b"Traceback" not in response.content


def test_other_errors_are_left_to_djangos_500():
    assert answer("/jobs/", ValueError("a bug")) is None


def test_a_database_error_raised_in_a_middleware_also_answers_503():
    # Django calls handler500 inside its except block; a session read that failed lands here.
    request = RequestFactory().get("/api/v1/nodes/")
    try:
        raise DOWN
    except OperationalError:
        response = crashed(request)
    assert response.status_code == 503 and json.loads(response.content)["code"] == "unavailable"
    try:
        raise ValueError("a bug")
    except ValueError:
        assert crashed(request).status_code == 500


def test_the_log_says_what_the_database_answered(caplog):
    """A refused connection and a pool that gave none in time are different problems (down,
    overloaded): the warning beside each 503 names which."""
    answer("/api/v1/jobs/", DOWN)
    answer("/jobs/", OperationalError("couldn't get a connection after 5.00 sec"))
    warnings = [r.getMessage() for r in caplog.records if "answered 503" in r.getMessage()]
    assert "Connection refused" in warnings[0] and "OperationalError" in warnings[0]
    assert "couldn't get a connection after 5.00 sec" in warnings[1]
