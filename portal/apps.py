from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Hangar portal"

    def ready(self) -> None:
        from portal.api import schema  # noqa: F401  (registers the token scheme with drf-spectacular)
