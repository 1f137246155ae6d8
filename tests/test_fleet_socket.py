"""The fleet websocket reads the database once per poll for all the browsers connected to a process."""

import asyncio
import json
import time

from asgiref.sync import async_to_sync, sync_to_async
from asgiref.testing import ApplicationCommunicator

from fleet import consumers
from fleet.consumers import FleetConsumer
from tests.factories import make_node


async def connect(user, query: str = "") -> ApplicationCommunicator:
    scope = {"type": "websocket", "path": "/ws/fleet/", "query_string": query.encode(), "user": user}
    communicator = ApplicationCommunicator(FleetConsumer.as_asgi(), scope)
    await communicator.send_input({"type": "websocket.connect"})
    assert (await communicator.receive_output(timeout=5))["type"] == "websocket.accept"
    return communicator


async def next_message(communicator) -> dict:
    return json.loads((await communicator.receive_output(timeout=5))["text"])


def test_n_sockets_cost_one_database_poll_per_tick(transactional_db, owner, settings):
    settings.HANGAR_FLEET_POLL_SECONDS = 0.2
    make_node("ws-1")
    make_node("ws-2").cordon(None, "maintenance")

    async def scenario():
        sockets = [await connect(owner) for _ in range(10)] + [await connect(owner, "state=cordoned")]
        firsts = [await next_message(s) for s in sockets]
        poller = consumers.poller()
        polls_before, started = poller.polls, time.monotonic()
        await asyncio.sleep(1.0)
        polls, elapsed = poller.polls - polls_before, time.monotonic() - started

        # A change reaches every socket from the same poll.
        await sync_to_async(lambda: make_node("ws-3").cordon(None, "new rack"))()
        updates = [await next_message(s) for s in sockets]
        for s in sockets:
            await s.send_input({"type": "websocket.disconnect", "code": 1000})
            await s.wait(timeout=2)
        return firsts, updates, polls, elapsed, poller

    firsts, updates, polls, elapsed, poller = async_to_sync(scenario)()

    assert [n["name"] for n in firsts[0]["nodes"]] == ["ws-1", "ws-2"]
    assert [n["name"] for n in firsts[-1]["nodes"]] == ["ws-2"]  # each socket gets its own view
    assert all(m == firsts[0] for m in firsts[:10])
    # One poll per tick for eleven sockets (two views), not one per socket.
    assert 1 <= polls <= elapsed / 0.2 + 1
    assert all(u["counts"] == {"ready": 1, "cordoned": 2} for u in updates)
    assert [n["name"] for n in updates[-1]["nodes"]] == ["ws-2", "ws-3"]
    assert poller.task is None and not poller.subscribers  # the last socket gone stops the poller
