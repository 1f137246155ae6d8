"""A secret Hangar generates once into its data directory (the secret key, the scrape token).

Written whole under a temporary name and linked into place, so two processes starting at once
agree on one secret and neither reads a half-written file. Read through O_NOFOLLOW, and refused
when other users can read it: jobs run as other uids.
"""

import os
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured


def ensure(path: Path, nbytes: int, why: str) -> tuple[str, bool]:
    """The secret kept at `path`, and whether this call generated it (then it may be shown once).
    `why` says what the secret guards, in the refusal of a file others can read."""
    try:
        return read(path, why), False
    except FileNotFoundError:
        pass
    value = secrets.token_urlsafe(nbytes)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(value + "\n")
        os.link(temp, path)  # fails where another process linked its own first: theirs is the one
    except FileExistsError:
        return read(path, why), False
    finally:
        os.unlink(temp)
    return value, True


def read(path: Path, why: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as file:
        if (mode := os.fstat(file.fileno()).st_mode & 0o777) & 0o077:
            raise ImproperlyConfigured(
                f"{path} is readable by other users (mode {mode:04o}), jobs included: {why}. "
                f"Run `chmod 600 {path}` (and `chmod 700 {path.parent}`), then start again"
            )
        return file.read().strip()
