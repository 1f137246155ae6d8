"""Log retention: lines older than HANGAR_LOG_RETENTION_DAYS are deleted by the
scheduler's periodic loop, a bounded number of batches per pass so a large
backlog never holds up scheduling; a pass that hit its bound runs again on the
next tick."""

import logging
import time

from django.conf import settings

from jobs.models import LogLine

log = logging.getLogger("hangar.scheduler")

BATCH = 10_000
BATCHES_PER_PASS = 10

_next_run = 0.0


def enforce_retention_if_due() -> int:
    """Delete expired lines when the retention interval has passed; the number deleted."""
    global _next_run
    now = time.monotonic()
    if now < _next_run:
        return 0
    deleted = LogLine.delete_expired(settings.HANGAR_LOG_RETENTION_DAYS, batch=BATCH, max_batches=BATCHES_PER_PASS)
    backlog = deleted >= BATCH * BATCHES_PER_PASS
    _next_run = now + (0 if backlog else settings.HANGAR_LOG_RETENTION_INTERVAL_SECONDS)
    if deleted:
        log.info("log retention: deleted %d lines older than %g days", deleted, settings.HANGAR_LOG_RETENTION_DAYS)
    return deleted
