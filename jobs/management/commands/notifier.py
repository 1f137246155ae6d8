import logging
import threading

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import DatabaseError, close_old_connections

from jobs import notify, settling, tracking
from portal.celery import app

log = logging.getLogger("hangar.notify")

SWEEP_SECONDS = 30.0


def sweep(stop: threading.Event) -> None:
    """Send again the deliveries whose message was lost: the database row is the record."""
    while not stop.wait(SWEEP_SECONDS):
        try:
            notify.resend_overdue()
        except DatabaseError as exc:
            log.warning("notification sweep failed: %s", exc)
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


def settle_forever(stop: threading.Event) -> None:
    """Settle ended attempts a moment after their end: their cost, MLflow run and events (jobs/settling.py)."""
    while not stop.wait(settings.HANGAR_SETTLE_POLL_SECONDS):
        try:
            settle_round(stop)
        except DatabaseError as exc:
            log.warning("settling failed: %s", exc)
        except Exception:  # an error in one round must not end the loop
            log.exception("settling failed")
        finally:
            close_old_connections()


class Command(BaseCommand):
    help = "Run the notifier: a Celery worker for webhooks and e-mail; it settles ended attempts (cost, MLflow run)."

    def add_arguments(self, parser):
        parser.add_argument("--concurrency", type=int, default=4, help="Deliveries in flight at once.")

    def handle(self, *args, concurrency, **options):
        stop = threading.Event()
        threading.Thread(target=sweep, args=(stop,), daemon=True, name="notify-sweep").start()
        threading.Thread(target=settle_forever, args=(stop,), daemon=True, name="settle").start()
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
