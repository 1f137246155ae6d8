"""Waking the scheduler: any floor may ask for a scheduling pass (a submit, an attempt's
end, a node's change of state) with `request_pass()`; the wake-up leaves after the
transaction commits, from one thread per process, as the task `hangar.schedule` sent by
name (jobs/tasks.py runs it). A leaf: it imports no app."""

import atexit
import logging
import os
import threading
import time

from django.db import transaction

from portal.celery import SCHEDULER_QUEUE, app

log = logging.getLogger("hangar.scheduler")

WAKEUP_COALESCE_SECONDS = 0.05


def clock_id() -> str | None:
    """Which clock `time.time()` reads here: the running kernel's boot id. Processes on one
    machine (containers included: the wall clock is not namespaced) share it and so read one
    clock; another machine's differs. None where there is no such file (then every wake-up
    allows for clocks that differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


CLOCK = clock_id()


def request_pass(queue_changed: bool = True) -> None:
    """Ask the scheduler for a pass as soon as the current transaction commits.

    `queue_changed=False` says the commit changed only what the fleet can run (GPUs freed by
    an attempt's end that queued nothing, a node's state, its environments): a pass that read
    the fleet after it answers it, even one that had read the queue before.

    Only a wake-up: if the broker is unreachable the periodic pass places the
    work, so a failed send is logged, never raised into the caller.
    """
    transaction.on_commit(send_pass_request if queue_changed else send_fleet_pass_request)


def send_pass_request() -> None:
    """Flag that a wake-up is wanted; this process's waker thread sends it."""
    _waker.request(queue_changed=True)


def send_fleet_pass_request() -> None:
    _waker.request(queue_changed=False)


class Waker:
    """Sends this process's wake-ups to the scheduler from one thread of its own, so a
    request never waits on the broker (and the Celery result backend, one per thread,
    is made once). After each send it rests WAKEUP_COALESCE_SECONDS: a burst of submits
    costs a few passes, not one each, and a flag raised after a send began is answered
    by the next send, so every commit is still followed by a wake-up.

    A wake-up carries the time of the latest request it answers, taken after that request's
    commit, not the time it left: a pass that began in between read the queue after every
    commit it answers, and the scheduler skips it (jobs/scheduler.py `pass_already_covers`).
    It also carries the time of the latest of them that changed the queue (None when none
    did): for the others a pass that read the fleet after them is enough, and most requests
    under load are an attempt's end, whose GPUs the pass running at that moment often hands
    out already (bench/throughput.py: a quarter of the passes placed nothing).
    On a busy machine the send lags the commit by tens of milliseconds, and a wake-up timed
    at its send ran a pass of its own that found the GPUs it freed handed out already."""

    def __init__(self):
        self.wanted = threading.Event()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.pending = threading.Lock()
        self.requested_at: float | None = None  # the latest request not yet sent
        self.queue_at: float | None = None  # the latest of them that changed the queue

    def request(self, queue_changed: bool = True) -> None:
        with self.pending:  # before the flag: the send that takes them reads these or later
            self.requested_at = time.time()
            if queue_changed:
                self.queue_at = self.requested_at
        self.wanted.set()
        if self.thread is None or not self.thread.is_alive():
            with self.lock:
                if self.thread is None or not self.thread.is_alive():
                    self.thread = threading.Thread(target=self.run, name="scheduler-wakeup", daemon=True)
                    self.thread.start()

    def run(self) -> None:
        while True:
            self.wanted.wait()
            self.wanted.clear()
            self.send()
            time.sleep(WAKEUP_COALESCE_SECONDS)

    def send(self) -> None:
        with self.pending:
            requested_at, queue_at = self.requested_at, self.queue_at
            self.requested_at = self.queue_at = None
        if requested_at is not None:  # else a send before this one took the requests
            _publish_wakeup(requested_at, queue_at)

    def flush(self) -> None:
        """At exit: send a wake-up still wanted (a short command that submitted work)."""
        if self.wanted.is_set():
            self.wanted.clear()
            self.send()


_waker = Waker()
# A forked child (a worker pool) starts with no waker thread and fresh locks.
os.register_at_fork(after_in_child=_waker.__init__)
atexit.register(lambda: _waker.flush())


def _publish_wakeup(requested_at: float, queue_at: float | None) -> None:
    try:
        kwargs = {"requested_at": requested_at, "queue_at": queue_at, "clock": CLOCK}
        app.send_task("hangar.schedule", kwargs=kwargs, queue=SCHEDULER_QUEUE)
    except Exception as exc:
        log.warning("scheduling pass not requested (the periodic pass will run): %s", exc)
