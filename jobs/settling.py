"""An attempt's end, settled a moment after the transaction that ended it: its cost, its
job's MLflow run, and the event its subscribers hear (its job's end, a budget crossed).

The transaction that ends an attempt does what the next job needs: the attempt's state, its
job moved on, its GPUs free, the scheduler woken (and the dependents of a job that is over
settled after its commit). The rest waits: the notifier settles every attempt ended more than
HANGAR_SETTLE_DELAY_SECONDS (1 s) ago, looking every HANGAR_SETTLE_POLL_SECONDS (one indexed
read of the few unsettled attempts; nothing is sent per end). When many GPUs free at once (a
round of short jobs that started together), each end's bookkeeping had come first and the next
round's starts waited behind it for the CPU and the database: bench/throughput.py (services,
4 x 8 GPUs, eight default runs in turns with the code before) read a hand-off p99 of 252-369 ms
(median 312) with the cost in the ending transaction and the MLflow update sent at once, and
214-262 ms (median 232) with both settled a second later.

Exactly once: `Attempt.priced_at`, set in the transaction that adds the cost; two settlers
(two notifiers, a notifier and the scheduler's reconciler) cannot both add it. The scheduler's
reconciler settles what is HANGAR_SETTLE_OVERDUE_SECONDS old, so costs and budgets stay right
while no notifier runs. Until it is settled an ended attempt's cost is missing from its job's
and the day's (a budget counts it a second late).
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from jobs import notify, tracking
from jobs.models import Attempt, JobCost

log = logging.getLogger("hangar.settling")

SETTLE_BATCH = 200  # read at once; a round reads batches until one is short


def settle(attempt_id: int) -> bool:
    """Add the ended attempt's cost, then bring its job's MLflow run up to date and tell who
    subscribed. False when it was settled already, or has not ended."""
    with transaction.atomic():
        job_id = JobCost.record_attempt(attempt_id)
        if job_id is None:
            return False
        notify.announce("attempt", attempt_id)  # once the cost is committed: a budget may have crossed a threshold
    tracking.attempt_finished(job_id)
    return True


def settle_due(older_than: float | None = None, now=None) -> list[int]:
    """Settle the attempts ended more than `older_than` seconds ago (HANGAR_SETTLE_DELAY_SECONDS)
    and not settled yet, oldest first, at most SETTLE_BATCH; the ids it settled."""
    older_than = settings.HANGAR_SETTLE_DELAY_SECONDS if older_than is None else older_than
    cutoff = (now or timezone.now()) - timedelta(seconds=older_than)
    due = Attempt.objects.filter(priced_at=None, finished_at__isnull=False, finished_at__lte=cutoff)
    settled = []
    for pk in due.order_by("finished_at").values_list("pk", flat=True)[:SETTLE_BATCH]:
        try:
            if settle(pk):
                settled.append(pk)
        except Exception:  # one attempt that cannot be settled must not hold back the ones after it
            log.exception("attempt %s: settling failed; tried again at the next look", pk)
    return settled


def settle_overdue(now=None) -> list[int]:
    """The scheduler's reconciler: settle what no notifier settled within HANGAR_SETTLE_OVERDUE_SECONDS."""
    settled = settle_due(settings.HANGAR_SETTLE_OVERDUE_SECONDS, now)
    if settled:
        log.warning("settled %d ended attempts no notifier settled: %s", len(settled), settled[:20])
    return settled
