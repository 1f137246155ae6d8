"""Job secrets encrypted at rest: each value of `Job.secret_env` is a Fernet token in the
database (the variable names stay readable: pages list them, masked).

Keys: HANGAR_SECRETS_KEY, a comma-separated list of Fernet keys (generate one with
`python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"`).
The first encrypts; every key, and then a key derived from SECRET_KEY, decrypts. So a
new key goes first and the old ones stay listed until `manage.py reseal_secrets` has
encrypted every stored secret with the new one. Without HANGAR_SECRETS_KEY the key is
derived from SECRET_KEY: changing SECRET_KEY then makes stored secrets unreadable (jobs
that need them fail to start, saying so), unless HANGAR_SECRETS_KEY is set first.
Agents decrypt when they start a job, so they need the same keys as the portal.
"""

import base64
import functools
import logging

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.db import models
from django.utils.crypto import salted_hmac

log = logging.getLogger("hangar.secrets")


class SecretUnreadable(OSError):
    """A stored secret that none of the configured keys decrypts. An OSError, so a Runner
    that meets it while starting a job fails the attempt with this message."""


def derived_key(secret_key: str) -> bytes:
    digest = salted_hmac("hangar.jobs.secrets", "fernet", secret=secret_key, algorithm="sha256").digest()
    return base64.urlsafe_b64encode(digest)


@functools.lru_cache(maxsize=4)
def _fernet(keys: tuple[str, ...], secret_key: str) -> MultiFernet:
    return MultiFernet([Fernet(k.encode()) for k in keys] + [Fernet(derived_key(secret_key))])


def fernet() -> MultiFernet:
    return _fernet(tuple(settings.HANGAR_SECRETS_KEY), settings.SECRET_KEY)


def seal(value: str) -> str:
    return fernet().encrypt(str(value).encode()).decode()


def unseal(token: str) -> str | None:
    """The plaintext of a token, or None when no configured key opens it."""
    try:
        return fernet().decrypt(str(token).encode()).decode()
    except InvalidToken:
        return None


class SecretEnvField(models.JSONField):
    """A JSON object of variable names to values whose values are encrypted at rest.

    In Python the values are plaintext (so the Runner, resubmit and the API's masking
    work on a plain dict); a value no key decrypts reads as None and is logged."""

    def get_db_prep_save(self, value, connection):
        if isinstance(value, dict):
            value = {str(k): seal(v) for k, v in value.items()}
        return super().get_db_prep_save(value, connection)

    def from_db_value(self, value, expression, connection):
        value = super().from_db_value(value, expression, connection)
        if not isinstance(value, dict):
            return value
        opened = {k: unseal(v) for k, v in value.items()}
        if unreadable := sorted(k for k, v in opened.items() if v is None):
            log.error("job secrets %s: no key in HANGAR_SECRETS_KEY decrypts them", ", ".join(unreadable))
        return opened


def process_env(secret_env: dict) -> dict[str, str]:
    """The secrets as a job's environment; refuses to start the job without one of them."""
    if unreadable := sorted(k for k, v in secret_env.items() if v is None):
        raise SecretUnreadable(
            f"secret {', '.join(unreadable)} cannot be decrypted with this agent's keys; "
            "set HANGAR_SECRETS_KEY (or SECRET_KEY) as on the portal, or resubmit the job with the secret"
        )
    return {str(k): str(v) for k, v in secret_env.items()}
