"""Log hints: every writer of an agent sends through one event loop, without waiting."""

import threading
import uuid

import pytest
from asgiref.sync import async_to_sync
from channels.layers import channel_layers

from agent import hints
from tests.factories import services_database
from tests.livestack import REDIS_TEST_URL


@pytest.fixture
def redis_layer(settings):
    services_database()  # Redis must answer (skipped outside CI where it does not)
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_TEST_URL], "prefix": f"hints-{uuid.uuid4().hex[:8]}"},
        }
    }
    channel_layers.backends.clear()
    yield channel_layers["default"]
    channel_layers.backends.clear()


def test_hints_of_many_writers_arrive_through_one_loop(redis_layer):
    sender = hints.HintSender()
    viewer = async_to_sync(redis_layer.new_channel)()
    async_to_sync(redis_layer.group_add)("job-1", viewer)

    def writer(attempt: int) -> None:
        for seq in range(5):
            assert sender.send("job-1", {"type": "log.appended", "attempt": attempt, "seq": seq})

    threads = [threading.Thread(target=writer, args=(attempt,)) for attempt in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    async def receive_all() -> list[dict]:  # one loop: channels_redis buffers a process's channels per loop
        return [await redis_layer.receive(viewer) for _ in range(20)]

    received = {(m["attempt"], m["seq"]) for m in async_to_sync(receive_all)()}
    assert received == {(attempt, seq) for attempt in range(4) for seq in range(5)}
    assert [t.name for t in threading.enumerate()].count("log-hints") >= 1 and sender.loop.is_running()
    assert sender.in_flight == 0 and sender.dropped == 0


def test_hints_beyond_the_limit_are_dropped_not_queued(redis_layer, monkeypatch):
    monkeypatch.setattr(hints, "MAX_IN_FLIGHT", 0)
    sender = hints.HintSender()
    assert not sender.send("job-1", {"type": "log.appended", "attempt": 1, "seq": 0})
    assert sender.dropped == 1 and sender.loop is None


def test_no_layer_no_hint(settings):
    settings.CHANNEL_LAYERS = {}
    channel_layers.backends.clear()
    assert not hints.HintSender().send("job-1", {"type": "log.appended", "attempt": 1, "seq": 0})
