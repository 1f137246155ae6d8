"""The bearer token a Prometheus scrape of /metrics presents.

HANGAR_METRICS_TOKEN when set; else a token generated once into the data directory (0600,
like the secret key), which `manage.py up` prints at the start that made it. Never an
address: a job of network `host` shares the portal host's loopback.
"""

import os
import secrets

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def ensure() -> tuple[str, bool]:
    """The token, and whether this call generated it (then it is shown once)."""
    if token := settings.HANGAR_METRICS_TOKEN:
        return token, False
    path = settings.HANGAR_METRICS_TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return read(), False
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    return token, True


def read() -> str:
    path = settings.HANGAR_METRICS_TOKEN_FILE
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as file:
        if (mode := os.fstat(file.fileno()).st_mode & 0o777) & 0o077:
            raise ImproperlyConfigured(
                f"{path} is readable by other users (mode {mode:04o}), jobs included: run `chmod 600 {path}`"
            )
        return file.read().strip()


def current() -> str:
    """What a scrape must present (read at each scrape: a new file needs no restart)."""
    return ensure()[0]
