"""Push hints to the channel layer ("lines were stored"), one event loop per agent process.

A hint only tells open log websockets to read the database now rather than at their next
poll, so it is sent without waiting and a lost one only delays a viewer. Each log writer
used to run its hints on an event loop of its own: channels_redis keeps its Redis
connections per loop, so every attempt opened (and health-checked) a new connection, ~9 %
of an agent's CPU on short jobs in services mode. Here every writer of the process hands
its hints to one loop on one thread, which keeps its connection.
"""

import asyncio
import logging
import threading

from channels.layers import get_channel_layer

log = logging.getLogger("hangar.agent")

MAX_IN_FLIGHT = 1000  # hints not yet sent (the layer is slow or down): more are dropped


class HintSender:
    def __init__(self):
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0
        self.dropped = 0

    def send(self, group: str, message: dict) -> bool:
        """Queue the hint for the group; False when there is no layer or too many wait."""
        layer = get_channel_layer()
        if layer is None:
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

    def _sent(self, future) -> None:
        with self.lock:
            self.in_flight -= 1
        if not future.cancelled() and future.exception() is not None:
            log.debug("log hint not sent: %s", future.exception())


sender = HintSender()
