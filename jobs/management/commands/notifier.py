import logging
import threading

from django.core.management.base import BaseCommand
from django.db import DatabaseError, close_old_connections

from jobs import notify, tracking
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


class Command(BaseCommand):
    help = "Run the notifier: a Celery worker for webhooks, e-mail and the MLflow runs' updates after an attempt."

    def add_arguments(self, parser):
        parser.add_argument("--concurrency", type=int, default=4, help="Deliveries in flight at once.")

    def handle(self, *args, concurrency, **options):
        stop = threading.Event()
        threading.Thread(target=sweep, args=(stop,), daemon=True, name="notify-sweep").start()
        self.stdout.write("notifier started")
        app.worker_main(
            [
                "--quiet",
                "worker",
                "--queues",
                f"{notify.QUEUE},{tracking.QUEUE}",  # deliveries; MLflow runs' updates after an attempt
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
