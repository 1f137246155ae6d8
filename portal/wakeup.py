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

from portal.celery import app

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


def request_pass() -> None:
    """Ask the scheduler for a pass as soon as the current transaction commits.

    Only a wake-up: if the broker is unreachable the periodic pass places the
    work, so a failed send is logged, never raised into the caller.
    """
    transaction.on_commit(send_pass_request)


def send_pass_request() -> None:
    """Flag that a wake-up is wanted; this process's waker thread sends it."""
    _waker.request()


class Waker:
    """Sends this process's wake-ups to the scheduler from one thread of its own, so a
    request never waits on the broker (and the Celery result backend, one per thread,
    is made once). After each send it rests WAKEUP_COALESCE_SECONDS: a burst of submits
    costs a few passes, not one each, and a flag raised after a send began is answered
    by the next send, so every commit is still followed by a wake-up.

    A wake-up carries the time of the latest request it answers, taken after that request's
    commit, not the time it left: a pass that began in between read the queue after every
    commit it answers, and the scheduler skips it (jobs/scheduler.py `pass_already_covers`).
    On a busy machine the send lags the commit by tens of milliseconds, and a wake-up timed
    at its send ran a pass of its own that found the GPUs it freed handed out already."""

    def __init__(self):
        self.wanted = threading.Event()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.requested_at = 0.0

    def request(self) -> None:
        self.requested_at = time.time()  # before the flag: the send that clears it reads this or later
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
            _publish_wakeup(self.requested_at)
            time.sleep(WAKEUP_COALESCE_SECONDS)

    def flush(self) -> None:
        """At exit: send a wake-up still wanted (a short command that submitted work)."""
        if self.wanted.is_set():
            self.wanted.clear()
            _publish_wakeup(self.requested_at)


_waker = Waker()
# A forked child (a worker pool) starts with no waker thread and fresh locks.
os.register_at_fork(after_in_child=_waker.__init__)
atexit.register(lambda: _waker.flush())


def _publish_wakeup(requested_at: float) -> None:
    try:
        kwargs = {"requested_at": requested_at, "clock": CLOCK}
        app.send_task("hangar.schedule", kwargs=kwargs, queue="hangar.scheduler")
    except Exception as exc:
        log.warning("scheduling pass not requested (the periodic pass will run): %s", exc)
