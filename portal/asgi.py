import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

from django.core.wsgi import get_wsgi_application  # noqa: E402

django_app = get_wsgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import OriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import StaticFilesHandler  # noqa: E402
from django.urls import path  # noqa: E402

from fleet.consumers import FleetConsumer  # noqa: E402
from jobs.consumers import JobLogConsumer  # noqa: E402
from portal.auth import WebsocketTokenMiddleware  # noqa: E402
from portal.sync_http import SyncHttpApp  # noqa: E402


class BrowserOriginValidator(OriginValidator):
    """Browsers must come from an allowed host (no cross-site hijacking of the
    session cookie); clients that send no Origin, like the CLI, authenticate by token."""

    def valid_origin(self, parsed_origin):
        return parsed_origin is None or super().valid_origin(parsed_origin)


websocket_urlpatterns = [
    path("ws/jobs/<int:job_id>/logs/", JobLogConsumer.as_asgi()),
    path("ws/fleet/", FleetConsumer.as_asgi()),
]

application = ProtocolTypeRouter(
    {
        # Every view is synchronous: requests run whole on a pool thread (portal.sync_http).
        # Static files are served by the project itself: the UI works offline, no CDN.
        "http": SyncHttpApp(StaticFilesHandler(django_app), settings.HANGAR_WEB_THREADS),
        "websocket": BrowserOriginValidator(
            AuthMiddlewareStack(WebsocketTokenMiddleware(URLRouter(websocket_urlpatterns))), settings.ALLOWED_HOSTS
        ),
    }
)
