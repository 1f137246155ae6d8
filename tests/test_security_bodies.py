"""Request bodies over their limit are answered 413 in the error shape, before they are
read (portal.bodylimits): from Content-Length at the web server, counted when sent
without one, and again in Django for requests that come another way."""

import asyncio
import json

import pytest

from portal.sync_http import SyncHttpApp
from tests.factories import api_client
from tests.test_sync_http import echo_app, scope


def send_huge(app: SyncHttpApp, headers, declared: int | None, pieces: int = 10_000, piece: int = 64 * 1024):
    """POST a body of `pieces` x `piece` bytes; the messages sent back and how many pieces were read."""
    sent, read = [], [0]
    if declared is not None:
        headers = [*headers, (b"content-length", str(declared).encode())]

    async def exchange():
        async def receive():
            read[0] += 1
            return {"type": "http.request", "body": b"x" * piece, "more_body": read[0] < pieces}

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(app(scope("POST", "/login/", headers=headers), receive, send), 10)

    asyncio.run(exchange())
    return sent, read[0]


def test_an_anonymous_500_mb_post_is_refused_before_a_byte_is_read():
    sent, read = send_huge(SyncHttpApp(echo_app, threads=1), [], declared=500 * 1024 * 1024)
    assert read == 0
    assert sent[0]["status"] == 413
    body = json.loads(sent[1]["body"])
    assert body["code"] == "too_large" and body["errors"][0]["field"] == "body"
    assert "without signing in" in body["message"]


def test_a_body_without_content_length_stops_being_read_at_the_limit(settings):
    sent, read = send_huge(SyncHttpApp(echo_app, threads=1), [], declared=None)
    assert sent[0]["status"] == 413
    assert read * 64 * 1024 <= settings.HANGAR_MAX_ANONYMOUS_BODY_BYTES + 64 * 1024


def test_signed_in_requests_get_the_larger_limit(settings):
    app = SyncHttpApp(echo_app, threads=1)
    size = settings.HANGAR_MAX_ANONYMOUS_BODY_BYTES * 2
    headers = [(b"authorization", b"Bearer abc")]
    sent, _ = send_huge(app, headers, declared=size, pieces=2, piece=size // 2)
    assert sent[0]["status"] == 201
    sent, read = send_huge(app, headers, declared=settings.HANGAR_MAX_BODY_BYTES + 1)
    assert sent[0]["status"] == 413 and read == 0


def test_an_invalid_content_length_is_a_400():
    sent, read = send_huge(SyncHttpApp(echo_app, threads=1), [(b"content-length", b"lots")], declared=None)
    assert sent[0]["status"] == 400 and read == 0
    assert json.loads(sent[1]["body"])["errors"][0]["field"] == "Content-Length"


@pytest.mark.django_db
def test_django_refuses_an_oversize_body_in_the_error_shape(owner, settings):
    response = api_client(owner).generic(
        "POST", "/api/v1/jobs/", b"{" + b" " * (settings.HANGAR_MAX_BODY_BYTES + 10) + b"}", "application/json"
    )
    assert response.status_code == 413
    assert response.json()["code"] == "too_large"
    anonymous = api_client().generic("POST", "/login/", b"x" * (settings.HANGAR_MAX_ANONYMOUS_BODY_BYTES + 1))
    assert anonymous.status_code == 413
