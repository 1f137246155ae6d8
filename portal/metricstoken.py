"""The bearer token a Prometheus scrape of /metrics presents.

HANGAR_METRICS_TOKEN when set; else a token generated once into the data directory the way the
secret key is (`portal.secretfile`), which `manage.py up` prints at the start that made it.
Never an address: a job of network `host` shares the portal host's loopback.
"""

from django.conf import settings

from portal import secretfile


def ensure() -> tuple[str, bool]:
    """The token, and whether this call generated it (then it is shown once)."""
    if token := settings.HANGAR_METRICS_TOKEN:
        return token, False
    return secretfile.ensure(settings.HANGAR_METRICS_TOKEN_FILE, 32, "it reads every series of /metrics")


def current() -> str:
    """What a scrape must present (read at each scrape: a new file needs no restart)."""
    return ensure()[0]
