"""Push hints to the channel layer ("lines were stored"), one event loop per agent process.

A hint only tells open log websockets to read the database now rather than at their next
poll, so it is sent without waiting and a lost one only delays a viewer. Each log writer
used to run its hints on an event loop of its own: channels_redis keeps its Redis
connections per loop, so every attempt opened (and health-checked) a new connection, ~9 %
of an agent's CPU on short jobs in services mode. Here every writer of the process hands
its hints to one loop on one thread, which keeps its connection.

Most jobs have nobody watching their log: a hint to a group with no member is not sent at
all (`watched`, one synchronous command). Through the loop it was two commands and the
loop's own work, ~2 ms of an agent's CPU a short job in services mode (bench/throughput.py),
a thirteenth of the agent's, for a message no one receives.
"""

import asyncio
import logging
import threading
import time

import redis
from channels.layers import get_channel_layer
from channels_redis.core import RedisChannelLayer

from portal.redisclients import redis_client

log = logging.getLogger("hangar.agent")

MAX_IN_FLIGHT = 1000  # hints not yet sent (the layer is slow or down): more are dropped
LOOK_AGAIN_SECONDS = 5.0  # after a look at a group's members failed: hints are sent unlooked meanwhile


class HintSender:
    def __init__(self):
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0
        self.dropped = 0
        self.unwatched = 0  # hints not sent: nobody was in their group
        self.look_again_at = 0.0  # time.monotonic(): until then, no look (the last one failed)

    def send(self, group: str, message: dict) -> bool:
        """Queue the hint for the group; False when there is no layer, nobody in the group
        or too many wait."""
        layer = get_channel_layer()
        if layer is None:
            return False
        if not self.watched(layer, group):
            with self.lock:
                self.unwatched += 1
            return False
        with self.lock:
            if self.in_flight >= MAX_IN_FLIGHT:
                self.dropped += 1
                if self.dropped % 1000 == 1:  # the first, then every thousandth: viewers fall back to polling
                    log.warning("log hints dropped (%d so far): the channel layer is not taking them", self.dropped)
                return False
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, daemon=True, name="log-hints").start()
            self.in_flight += 1
        future = asyncio.run_coroutine_threadsafe(layer.group_send(group, message), self.loop)
        future.add_done_callback(self._sent)
        return True

    def watched(self, layer, group: str) -> bool:
        """Whether the group has a member now. channels_redis keeps a group as one sorted set of
        its channels, each scored by when it joined; `group_send` drops those older than the
        layer's group_expiry and sends to the rest, so a count of the others is its answer.
        A viewer that joins after this look misses no line: its consumer joins the group
        before its first read of the stored lines (jobs/consumers.py), as with a hint sent to
        a group it was not yet in. The look waits a second at most (redis_client's timeout:
        the storer asks it, so a Redis that does not answer delays a batch of lines that
        much, not the layer's 30 s). Another layer or a host not given by its URL, or a look
        that failed: the hint is sent, and for LOOK_AGAIN_SECONDS after a failure every hint
        is sent without a look (the loop, not the storer, then waits on that Redis), so a
        Redis that does not answer holds no job's lines back by a second a batch."""
        if not isinstance(layer, RedisChannelLayer) or time.monotonic() < self.look_again_at:
            return True
        address = layer.hosts[layer.consistent_hash(group)].get("address")
        if address is None:
            return True
        since = int(time.time()) - layer.group_expiry  # group_send's own cut-off, excluded
        try:
            return redis_client(address).zcount(layer._group_key(group), f"({since}", "+inf") > 0
        except (redis.RedisError, OSError) as exc:
            log.debug("log hint: the group's members not read (%s): sent", exc)
            self.look_again_at = time.monotonic() + LOOK_AGAIN_SECONDS
            return True

    def _sent(self, future) -> None:
        with self.lock:
            self.in_flight -= 1
        if not future.cancelled() and future.exception() is not None:
            log.debug("log hint not sent: %s", future.exception())


sender = HintSender()
