import logging
import threading

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import DatabaseError, close_old_connections

from jobs import notify, settling, tracking
from portal.celery import app

log = logging.getLogger("hangar.notify")

SWEEP_SECONDS = 30.0


def repeat(stop: threading.Event, seconds: float, work, what: str) -> None:
    """Do `work` every `seconds` until `stop`; a failure is logged and never ends the loop."""
    while not stop.wait(seconds):
        try:
            work()
        except DatabaseError as exc:
            log.warning("%s failed: %s", what, exc)
        except Exception:
            log.exception("%s failed", what)
        finally:
            close_old_connections()


def settle_round(stop: threading.Event) -> int:
    """Settle every attempt ended long enough ago, a batch at a time (a backlog, after the
    notifier was down, is worked off at once); how many it settled."""
    settled = 0
    while not stop.is_set():
        batch = settling.settle_due()
        settled += len(batch)
        if len(batch) < settling.SETTLE_BATCH:
            return settled
    return settled


class Command(BaseCommand):
    help = "Run the notifier: a Celery worker for webhooks and e-mail; it settles ended attempts (cost, MLflow run)."

    def add_arguments(self, parser):
        parser.add_argument("--concurrency", type=int, default=4, help="Deliveries in flight at once.")

    def handle(self, *args, concurrency, **options):
        stop = threading.Event()
        # Deliveries whose message was lost are sent again: the database row is the record.
        sweep = (stop, SWEEP_SECONDS, notify.resend_overdue, "notification sweep")
        threading.Thread(target=repeat, args=sweep, daemon=True, name="notify-sweep").start()
        # Ended attempts settled a moment after their end: cost, MLflow run, events (jobs/settling.py).
        settle = (stop, settings.HANGAR_SETTLE_POLL_SECONDS, lambda: settle_round(stop), "settling")
        threading.Thread(target=repeat, args=settle, daemon=True, name="settle").start()
        self.stdout.write("notifier started")
        app.worker_main(
            [
                "--quiet",
                "worker",
                "--queues",
                f"{notify.QUEUE},{tracking.QUEUE}",  # deliveries; MLflow runs' updates an older Hangar sent
                # Threads: a slow receiver holds one of them, never the others' deliveries.
                "--pool",
                "threads",
                "--concurrency",
                str(concurrency),
                "--hostname",
                "notifier@%h",
                "--prefetch-multiplier",
                "1",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "WARNING",
            ]
        )
        stop.set()
