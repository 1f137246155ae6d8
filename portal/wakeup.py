"""Waking the scheduler: any floor may ask for a scheduling pass (a submit, an attempt's
end, a node's change of state) with `request_pass()`; the wake-up leaves after the
transaction commits (from the committing thread, or in a burst from one thread per
process: `Waker`), as the task `hangar.schedule` sent by name (jobs/tasks.py runs it). A
leaf: it imports no app."""

import atexit
import logging
import os
import threading
import time

from django.db import transaction

from portal.celery import SCHEDULER_QUEUE, app

log = logging.getLogger("hangar.scheduler")

WAKEUP_COALESCE_SECONDS = 0.05
# A request that comes alone, none other in its process for this long before it, is sent at
# once by its caller (`Waker`); those closer together are coalesced. Shorter than an idle
# node's start: one client submitting job after job, each once the last one started, is
# never coalesced (bench/start_latency.py submits ~45 ms apart: with every request held to
# a 50 ms rest after the last send, half of them waited, and a job was placed 10 ms after
# its row was made at p50, against 6.4 sent at once), and callers send at most 40 a second.
WAKEUP_ALONE_SECONDS = 0.025
# A send slower than this (a healthy one takes ~0.5 ms) sends the requests after it from the
# waker's thread, until one of its sends is quick again.
QUICK_SEND_SECONDS = 0.05


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
    """Ask for a wake-up: sent at once from this thread, or by the waker's (`Waker`)."""
    _waker.request(queue_changed=True)


def send_fleet_pass_request() -> None:
    _waker.request(queue_changed=False)


class Waker:
    """Sends this process's wake-ups to the scheduler. A request that comes alone (none in
    the WAKEUP_ALONE_SECONDS before it) is sent by the caller's own thread, at once. The
    others are flagged to the waker's thread, which sends them together, resting
    WAKEUP_COALESCE_SECONDS after each send (its own or a caller's): a burst of submits
    costs a few passes, not one each, and a request made after a send took the requests
    before it is answered by the next send, so every commit is still followed by a wake-up.

    Handed to the thread, a lone request left only when that thread got the GIL, most often
    once the caller's whole request was done (bench/start_latency.py, services: 2.6 ms p50
    from the commit to the send, of an idle node's 33 ms start); the caller now waits for
    its send (~0.5 ms). Under a flood (bench/api.py: a request every ~6 ms in each web
    process) the sends stay the thread's, where they were cheaper: sent by the request
    threads, submits/s read 4 % fewer. Only while sends are quick: after one that failed or
    was slow (the broker down or struggling) every request goes to the thread until a send
    of its is quick again, so a broker in trouble holds up one request at most, never each.

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
        self.asked_at = -WAKEUP_ALONE_SECONDS  # (monotonic) the latest request, sent or not
        self.sending = threading.Lock()  # held by whoever sends, and by the thread through its rest
        self.rest_until = 0.0  # (monotonic) the latest send's rest: no send before it ends
        self.quick = True  # the latest send went through, and quickly

    def request(self, queue_changed: bool = True) -> None:
        with self.pending:  # before the send: the send that takes them reads these or later
            self.requested_at, now = time.time(), time.monotonic()
            alone, self.asked_at = now - self.asked_at >= WAKEUP_ALONE_SECONDS, now
            if queue_changed:
                self.queue_at = self.requested_at
        if alone and self.quick and self.sending.acquire(blocking=False):
            try:
                self.send()
            finally:
                self.sending.release()
            return
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
            if self.requested_at is None:
                # A send since took what woke it (a caller's, or this thread's last one, of a
                # request flagged after it woke): no rest to hold, a request after this one flags it again.
                continue
            with self.sending:  # held through the rest: a request meanwhile leaves with this send
                time.sleep(max(0.0, self.rest_until - time.monotonic()))
                self.send()

    def send(self) -> None:
        """Send the requests not yet sent, if any (another send may have taken them). Its
        caller holds `sending`, but for `flush` at exit (a send beside the thread's is harmless)."""
        with self.pending:
            requested_at, queue_at = self.requested_at, self.queue_at
            self.requested_at = self.queue_at = None
        if requested_at is None:
            return
        began = time.monotonic()
        sent = _publish_wakeup(requested_at, queue_at)
        ended = time.monotonic()
        self.quick = sent and ended - began < QUICK_SEND_SECONDS
        self.rest_until = ended + WAKEUP_COALESCE_SECONDS

    def flush(self) -> None:
        """At exit: send a wake-up still wanted (a short command that submitted work)."""
        if self.wanted.is_set():
            self.wanted.clear()
            self.send()


_waker = Waker()
# A forked child (a worker pool) starts with no waker thread and fresh locks.
os.register_at_fork(after_in_child=_waker.__init__)
atexit.register(lambda: _waker.flush())


def _publish_wakeup(requested_at: float, queue_at: float | None) -> bool:
    """Whether the wake-up went to the broker."""
    try:
        kwargs = {"requested_at": requested_at, "queue_at": queue_at, "clock": CLOCK}
        app.send_task("hangar.schedule", kwargs=kwargs, queue=SCHEDULER_QUEUE)
        return True
    except Exception as exc:
        log.warning("scheduling pass not requested (the periodic pass will run): %s", exc)
        return False
