"""Long polls and streams are bounded per user and per process (portal.capacity): over a
bound, 429 with Retry-After; long polls never take every request thread, so short
requests are not starved."""

import asyncio
import time

import pytest

from portal.capacity import limits, slots
from portal.sync_http import SyncHttpApp
from tests.factories import api_client, in_thread, make_job, make_project, make_user
from tests.test_sync_http import scope


def follow(client, job, wait=3):
    return client.get(f"/api/v1/jobs/{job.pk}/logs/", {"follow": 1, "wait": wait})


@pytest.mark.django_db(transaction=True)
def test_a_users_long_polls_past_the_bound_are_refused_with_retry_after(settings):
    settings.HANGAR_LONG_POLLS_PER_USER = 1
    member = make_user("poller")
    job = make_job(make_project("polls", member=member), member)
    results: list = []
    waiting = in_thread(lambda: follow(api_client(member), job), results)
    time.sleep(0.5)
    refused = follow(api_client(member), job)
    assert refused.status_code == 429
    assert int(refused["Retry-After"]) >= 1
    assert refused.json()["code"] == "busy" and "long polls" in refused.json()["message"]
    assert api_client(member).get("/api/v1/projects/").status_code == 200  # short requests still pass
    waiting.join(10)
    assert results[0].status_code == 200
    assert follow(api_client(member), job, wait=0).status_code == 200  # the slot came back


def test_long_polls_leave_half_the_threads_to_short_requests(settings):
    settings.HANGAR_WEB_THREADS = 8
    settings.HANGAR_LONG_POLLS_PER_PROCESS = 0
    assert limits("long_poll")[1] == 4
    settings.HANGAR_LONG_POLLS_PER_PROCESS = 50
    assert limits("long_poll")[1] == 7


def test_a_stream_gives_its_slot_back_when_closed_unread():
    before = slots.by_kind["stream"]
    content = slots.hold_while("stream", 42, iter([b"a"]))
    assert slots.by_kind["stream"] == before + 1
    content.close()
    assert slots.by_kind["stream"] == before


@pytest.mark.django_db(transaction=True)
def test_eight_long_polls_do_not_starve_another_users_request(settings):
    """The audit's case through the web server's own thread pool: 4 threads, 8 long polls."""
    from portal.asgi import django_app

    settings.HANGAR_WEB_THREADS = 4
    settings.HANGAR_LONG_POLLS_PER_USER = 8
    from portal.models import ApiToken

    member, other = make_user("flooder"), make_user("bystander")
    job = make_job(make_project("flood", member=member), member)
    make_project("calm", member=other)
    _, flood_token = ApiToken.issue(member, "flood")
    _, other_token = ApiToken.issue(other, "calm")
    app = SyncHttpApp(django_app, threads=4)

    async def get(path: str, query: bytes, token: str) -> tuple[int, float]:
        headers = [(b"host", b"testserver"), (b"authorization", f"Bearer {token}".encode())]
        sent, asked, began = [], [], time.monotonic()

        async def receive():
            if asked:
                await asyncio.Event().wait()  # the client stays until the answer is whole
            asked.append(True)
            return {"type": "http.request", "body": b""}

        async def send(message):
            sent.append(message)

        await app(scope(path=path, query=query, headers=headers), receive, send)
        return sent[0]["status"], time.monotonic() - began

    async def scenario():
        polls = [
            asyncio.create_task(get(f"/api/v1/jobs/{job.pk}/logs/", b"follow=1&wait=4", flood_token)) for _ in range(8)
        ]
        await asyncio.sleep(0.5)
        short = await get("/api/v1/projects/", b"", other_token)
        return short, await asyncio.gather(*polls)

    (status, took), polls = asyncio.run(scenario())
    app.pool.shutdown(wait=True)
    print(f"capacity: short_request_s={took:.3f} polls_answered={sorted(code for code, _ in polls)}")
    assert status == 200
    assert took < 2.0, f"a short request waited {took:.1f}s behind long polls"
    assert sorted(code for code, _ in polls) == [200, 200, 429, 429, 429, 429, 429, 429]
