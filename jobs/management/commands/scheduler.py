import logging
import threading

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import DatabaseError, close_old_connections

from jobs import snapshots
from jobs.logretention import enforce_retention_if_due
from jobs.scheduler import reconcile, schedule_pass
from portal.celery import SCHEDULER_QUEUE, app, taken_without_ack

log = logging.getLogger("hangar.scheduler")


def periodic(stop: threading.Event, interval: float) -> None:
    """Reconcile and schedule on a timer too: a lost wake-up only delays work."""
    while not stop.wait(interval):
        try:
            reconcile()
            schedule_pass()
            enforce_retention_if_due()
            snapshots.enforce_retention_if_due()
        except DatabaseError as exc:
            log.warning("periodic pass failed: %s", exc)
        except Exception:  # a broker hiccup must not end the loop that recovers from lost messages
            log.exception("periodic pass failed")
        finally:
            close_old_connections()


class Command(BaseCommand):
    help = "Run the scheduler: a Celery worker for scheduling passes plus a periodic reconcile/schedule loop."

    def handle(self, *args, **options):
        stop = threading.Event()
        threading.Thread(
            target=periodic, args=(stop, settings.HANGAR_SCHEDULER_INTERVAL), daemon=True, name="periodic"
        ).start()
        self.stdout.write("scheduler started")
        app.worker_main(
            [
                "--quiet",
                "worker",
                "--queues",
                taken_without_ack(SCHEDULER_QUEUE),
                "--pool",
                "solo",
                "--hostname",
                "scheduler@%h",
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
