"""The fleet websocket: /ws/fleet/?state=&gpu=&page=

Sends the nodes of the page the browser shows (same filters and paging as
the page). One poller per process reads the database every
HANGAR_FLEET_POLL_SECONDS for all connected browsers: each distinct view
(filters and page) is read once per poll, however many browsers show it, and
every consumer sends its view's latest message. The stored telemetry is the
record, so a slow client only skips intermediate states.
"""

import asyncio
import json
import logging
import weakref
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db.models import Count

from fleet.messages import FleetMessage, node_wire
from fleet.models import Node
from portal import wsauth

log = logging.getLogger("hangar.web")
CLOSE_UNAUTHENTICATED = wsauth.CLOSE_UNAUTHENTICATED

ViewKey = tuple[tuple[str, str], ...]


class FleetPoller:
    """The process's one database reader for the fleet websocket, fanning out in process."""

    def __init__(self):
        self.subscribers: dict[FleetConsumer, ViewKey] = {}
        self.latest: dict[ViewKey, str] = {}
        self.polls = 0  # database polls made: one per tick, not one per browser
        self.poll_now = asyncio.Event()
        self.task: asyncio.Task | None = None

    def subscribe(self, consumer: "FleetConsumer") -> None:
        self.subscribers[consumer] = consumer.view
        if consumer.view in self.latest:
            consumer.wakeup.set()
        else:
            self.poll_now.set()  # a view nobody showed yet: read it now, not at the next tick
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self.run())

    def unsubscribe(self, consumer: "FleetConsumer") -> None:
        self.subscribers.pop(consumer, None)
        if not self.subscribers and self.task is not None:
            self.task.cancel()
            self.task = None
            self.latest.clear()

    async def run(self) -> None:
        while self.subscribers:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception:  # the database may be restarting: try again at the next tick
                log.exception("fleet stream poll failed")
            try:
                await asyncio.wait_for(self.poll_now.wait(), timeout=settings.HANGAR_FLEET_POLL_SECONDS)
            except TimeoutError:
                pass

    async def poll(self) -> None:
        self.poll_now.clear()
        views = set(self.subscribers.values())
        messages = await read_views(views)
        self.polls += 1
        changed = {view for view, message in messages.items() if self.latest.get(view) != message}
        self.latest.update(messages)
        for consumer, view in list(self.subscribers.items()):
            if view in changed:
                consumer.wakeup.set()


_pollers: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FleetPoller]" = weakref.WeakKeyDictionary()


def poller() -> FleetPoller:
    """This process's poller (one per event loop: a server process has one loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _pollers:
        _pollers[loop] = FleetPoller()
    return _pollers[loop]


def read_views_now(views: set[ViewKey]) -> dict[ViewKey, str]:
    """One database poll: the node counts once, and each view's page of nodes once."""
    from fleet.views import fleet_page

    counts = dict(Node.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    out = {}
    for view in views:
        page, _, _ = fleet_page(dict(view))
        message: FleetMessage = {"type": "nodes", "nodes": [node_wire(n) for n in page.object_list], "counts": counts}
        out[view] = json.dumps(message)
    return out


read_views = database_sync_to_async(read_views_now)


class FleetConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await wsauth.refuse(self, CLOSE_UNAUTHENTICATED)  # accepted, then closed with the code
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        params = {key: values[0] for key, values in query.items() if key in ("state", "gpu", "page")}
        self.view: ViewKey = tuple(sorted(params.items()))
        self.wakeup = asyncio.Event()
        await self.accept()
        self.poller = poller()
        self.pump = asyncio.create_task(self.follow())
        self.poller.subscribe(self)
        self.watcher = wsauth.watch(self)

    async def disconnect(self, code):
        if hasattr(self, "pump"):
            self.pump.cancel()
            self.watcher.cancel()
            self.poller.unsubscribe(self)

    async def follow(self):
        sent = None
        try:
            while True:
                await self.wakeup.wait()
                self.wakeup.clear()
                text = self.poller.latest.get(self.view)
                if text is not None and text != sent:
                    await self.send(text_data=text)
                    sent = text
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("fleet stream failed")
            await self.close(code=1011)
