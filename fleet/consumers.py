"""The fleet websocket: /ws/fleet/?state=&gpu=&page=

Sends the nodes of the page the browser shows (same filters and paging as
the page), read from the database every HANGAR_FLEET_POLL_SECONDS: the stored
telemetry is the record, so a slow client only skips intermediate states.
"""

import asyncio
import json
import logging
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db.models import Count

from fleet.messages import FleetMessage, node_wire
from fleet.models import Node

log = logging.getLogger("hangar.web")
CLOSE_UNAUTHENTICATED = 4401


class FleetConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        self.params = {key: values[0] for key, values in query.items() if key in ("state", "gpu", "page")}
        await self.accept()
        self.pump = asyncio.create_task(self.follow())

    async def disconnect(self, code):
        if hasattr(self, "pump"):
            self.pump.cancel()

    async def follow(self):
        last = None
        try:
            while True:
                message = await self.read()
                text = json.dumps(message)
                if text != last:
                    await self.send(text_data=text)
                    last = text
                await asyncio.sleep(settings.HANGAR_FLEET_POLL_SECONDS)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("fleet stream failed")
            await self.close(code=1011)

    @database_sync_to_async
    def read(self) -> FleetMessage:
        from fleet.views import fleet_page

        page, _, _ = fleet_page(self.params)
        counts = dict(Node.objects.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
        return {"type": "nodes", "nodes": [node_wire(n) for n in page.object_list], "counts": counts}
