from django.apps import AppConfig


class PortalConfig(AppConfig):
    name = "portal"
    verbose_name = "Hangar portal"

    def ready(self) -> None:
        from django.db.backends.signals import connection_created

        from portal import (
            multihost,  # noqa: F401  (registers its `check --deploy` rules)
            wsauth,  # noqa: F401  (a revocation closes sockets in whichever process makes it)
        )
        from portal.api import schema  # noqa: F401  (registers the token scheme with drf-spectacular)
        from portal.login import connect_signals
        from portal.patterns import install_sqlite_regexp

        connection_created.connect(install_sqlite_regexp, dispatch_uid="hangar.sqlite_regexp")
        connect_signals()
