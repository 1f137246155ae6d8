"""Log hints: every writer of an agent sends through one event loop, without waiting."""

import threading
import time
import uuid

import pytest
import redis
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
    async_to_sync(redis_layer.group_add)("job-1", async_to_sync(redis_layer.new_channel)())  # watched
    sender = hints.HintSender()
    assert not sender.send("job-1", {"type": "log.appended", "attempt": 1, "seq": 0})
    assert sender.dropped == 1 and sender.loop is None


def test_no_layer_no_hint(settings):
    settings.CHANNEL_LAYERS = {}
    channel_layers.backends.clear()
    assert not hints.HintSender().send("job-1", {"type": "log.appended", "attempt": 1, "seq": 0})


def test_a_hint_nobody_would_receive_is_not_sent(redis_layer):
    """A job nobody watches (most of them) costs no send: one look at its group's members."""
    sender = hints.HintSender()
    hint = {"type": "log.appended", "attempt": 1, "seq": 1}
    assert not sender.send("job-7", hint)
    assert sender.unwatched == 1 and sender.loop is None  # no loop was needed for it

    viewer = async_to_sync(redis_layer.new_channel)()
    async_to_sync(redis_layer.group_add)("job-7", viewer)
    assert sender.send("job-7", hint)
    assert async_to_sync(redis_layer.receive)(viewer)["seq"] == 1

    async_to_sync(redis_layer.group_discard)("job-7", viewer)
    assert not sender.send("job-7", hint)
    assert sender.unwatched == 2


def test_a_member_past_the_groups_expiry_does_not_count(redis_layer):
    """group_send would drop it without sending: the look agrees."""
    redis_layer.group_expiry = 1
    viewer = async_to_sync(redis_layer.new_channel)()
    async_to_sync(redis_layer.group_add)("job-8", viewer)
    sender = hints.HintSender()
    assert sender.watched(redis_layer, "job-8")
    time.sleep(2.1)  # its score (whole seconds) is then at or before the cut-off
    assert not sender.watched(redis_layer, "job-8")


def test_a_look_that_fails_sends_the_hint_as_before(settings):
    """Redis not answering the look: the hint goes to the loop, which drops it when it cannot send."""
    settings.CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": ["redis://127.0.0.1:9"]}}
    }
    channel_layers.backends.clear()
    try:
        sender = hints.HintSender()
        assert sender.send("job-9", {"type": "log.appended", "attempt": 1, "seq": 1})
        assert sender.unwatched == 0
    finally:
        channel_layers.backends.clear()


def test_after_a_failed_look_hints_go_unlooked_for_a_while(redis_layer, monkeypatch):
    """A Redis that does not answer the look (a second each) must not hold every batch of
    lines back: after one failure the storer does not ask again for LOOK_AGAIN_SECONDS."""
    looks = []

    class Unanswering:
        def zcount(self, *args):
            looks.append(args)
            raise redis.TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(hints, "redis_client", lambda url: Unanswering())
    sender = hints.HintSender()
    for _ in range(3):
        assert sender.watched(redis_layer, "job-10")
    assert len(looks) == 1
    sender.look_again_at = time.monotonic() - 1  # the back-off is over: the next hint looks again
    assert sender.watched(redis_layer, "job-10")
    assert len(looks) == 2
