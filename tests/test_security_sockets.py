"""Open websockets re-check their token or session (portal/wsauth.py) and close with the
documented code once it no longer holds; refusals carry their close code."""

import time

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.test import Client

from portal.models import ApiToken
from tests.factories import make_attempt, make_job
from tests.test_access import LogSocket, close_code

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def quick_recheck(settings):
    settings.HANGAR_WS_RECHECK_SECONDS = 0.2


@pytest.fixture
def running(project, owner, node):
    job = make_job(project, owner)
    make_attempt(job, node, "running")
    return job


async def closed_within(socket: LogSocket, seconds: float) -> tuple[int | None, float]:
    """Read until the socket is closed; its code and how long it took."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        message = await socket.receive_output(seconds)
        if message["type"] == "websocket.close":
            return message.get("code"), time.monotonic() - began
    return None, seconds


def test_a_revoked_token_closes_an_open_log_socket_with_4401(running, owner):
    token, raw = ApiToken.issue(owner, "ws")

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{running.pk}/logs/", [(b"authorization", f"Bearer {raw}".encode())])
        assert (await socket.connect()) == (True, None)
        await socket.receive_json()  # the first batch
        await database_sync_to_async(token.revoke)(owner)
        return await closed_within(socket, 5)

    code, took = async_to_sync(scenario)()
    assert code == 4401 and took < 2


def test_a_deactivated_user_is_closed_with_4401(running, owner):
    _, raw = ApiToken.issue(owner, "ws")

    def deactivate():
        owner.is_active = False
        owner.save(update_fields=["is_active"])

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{running.pk}/logs/", [(b"authorization", f"Bearer {raw}".encode())])
        await socket.connect()
        await database_sync_to_async(deactivate)()
        return await closed_within(socket, 5)

    assert async_to_sync(scenario)()[0] == 4401


def test_a_logged_out_session_closes_its_socket(running, owner):
    client = Client()
    client.force_login(owner)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{running.pk}/logs/", [(b"cookie", cookie)])
        assert (await socket.connect()) == (True, None)
        await database_sync_to_async(client.logout)()
        return await closed_within(socket, 5)

    assert async_to_sync(scenario)()[0] == 4401


def test_leaving_the_project_closes_with_4404(running, owner, project):
    _, raw = ApiToken.issue(owner, "ws")

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{running.pk}/logs/", [(b"authorization", f"Bearer {raw}".encode())])
        await socket.connect()
        await database_sync_to_async(lambda: project.memberships.filter(user=owner).delete())()
        return await closed_within(socket, 5)

    assert async_to_sync(scenario)()[0] == 4404


def test_refusals_are_accepted_then_closed_with_their_code(running, outsider, other_project, settings):
    _, raw = ApiToken.issue(outsider, "ws")
    assert close_code(f"/ws/jobs/{running.pk}/logs/") == 4401
    assert close_code(f"/ws/jobs/{running.pk}/logs/", [(b"authorization", f"Bearer {raw}".encode())]) == 4404
    assert close_code("/ws/fleet/") == 4401


def test_log_sockets_past_the_users_bound_are_closed_with_4429(running, owner, settings):
    settings.HANGAR_STREAMS_PER_USER = 1
    _, raw = ApiToken.issue(owner, "ws")
    headers = [(b"authorization", f"Bearer {raw}".encode())]

    async def scenario():
        first = LogSocket(f"/ws/jobs/{running.pk}/logs/", headers)
        await first.connect()
        second = LogSocket(f"/ws/jobs/{running.pk}/logs/", headers)
        accepted = await second.connect()
        code = (await second.receive_output(5)).get("code")
        await first.disconnect()
        third = LogSocket(f"/ws/jobs/{running.pk}/logs/", headers)
        reopened = await third.connect()
        await third.disconnect()
        return accepted, code, reopened

    assert async_to_sync(scenario)() == ((True, None), 4429, (True, None))


def test_a_nul_in_a_subscribed_filter_is_an_error_message_not_a_crash(running, owner):
    _, raw = ApiToken.issue(owner, "ws")

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{running.pk}/logs/", [(b"authorization", f"Bearer {raw}".encode())])
        await socket.connect()
        await socket.receive_json()
        await socket.send_input(
            {"type": "websocket.receive", "text": '{"type": "subscribe", "filters": {"q": "a\\u0000"}}'}
        )
        while (message := await socket.receive_json())["type"] != "error":
            pass
        await socket.disconnect()
        return message

    assert async_to_sync(scenario)()["field"] == "q"
