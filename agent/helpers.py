"""The runners' helper threads, kept and reused.

A runner starts helpers beside its job: its log writer and the writer's storer
(`output.LogWriter`), its MLflow run's start (`runner.InBackground`), the lease keeper of its
preflight (`Runner.keep_lease`) and one reader per output pipe (`LogWriter.read_from`). Each
used to be a thread of its own, and `Thread.start()` waits until the new thread runs: 0.3-0.7
ms on an agent busy starting the job, three times before the job's process starts
(bench/start_latency.py, from a trace of the start's steps), and each new thread's first query
set up a database connection of its own (its Django wrapper: ~0.15 ms of CPU).
Here a helper goes to a thread that finished its last one, without a wait, and to a new
thread only when none is idle; that thread then stays for the next. An agent keeps as many as
it ever ran at once (about four per GPU).

Daemon threads, as before: an agent that exits does not wait on a reader of a job's pipe.
A helper's own connection to the database is its to close (each one does), as it was its
thread's.
"""

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("hangar.agent")

IDLE_NAME = "helper (idle)"


class Running:
    """One call given to a helper: `join()` waits for its end, `is_alive()` says whether it has not
    ended yet (a thread's methods, for what was a thread of its own)."""

    def __init__(self):
        self.ended = threading.Event()

    def join(self, timeout: float | None = None) -> None:
        self.ended.wait(timeout)

    def is_alive(self) -> bool:
        return not self.ended.is_set()


class Helper(threading.Thread):
    """One kept thread: it runs the calls it is given, one at a time, and between them rests idle."""

    def __init__(self, helpers: "Helpers"):
        super().__init__(daemon=True, name=IDLE_NAME)
        self.helpers = helpers
        self.given = threading.Event()
        self.call: tuple[Callable, tuple, str, Running] | None = None

    def give(self, call: Callable, args: tuple, name: str) -> Running:
        running = Running()
        self.call = (call, args, name, running)
        self.given.set()
        return running

    def run(self) -> None:
        while True:
            self.given.wait()
            self.given.clear()
            call, args, name, running = self.call
            self.call = None
            self.name = name  # as a thread of its own was named: in logs, py-spy, faulthandler
            try:
                call(*args)
            except Exception:
                log.exception("%s failed", name)
            finally:
                call = args = None  # an idle helper keeps nothing of its last call (a job's pipes, its runner)
                self.name = IDLE_NAME
                self.helpers.rest(self)  # before the end is told: a start that follows a join finds it idle
                running.ended.set()


class Helpers:
    def __init__(self):
        self.lock = threading.Lock()
        self.idle: list[Helper] = []

    def start(self, call: Callable, *args, name: str) -> Running:
        """Run `call(*args)` on a helper thread and return at once."""
        with self.lock:
            helper = self.idle.pop() if self.idle else None
        if helper is not None:
            return helper.give(call, args, name)
        helper = Helper(self)
        running = helper.give(call, args, name)
        helper.start()
        return running

    def rest(self, helper: Helper) -> None:
        with self.lock:
            self.idle.append(helper)


HELPERS = Helpers()


def start(call: Callable, *args, name: str) -> Running:
    """Run `call(*args)` on one of this agent's helper threads (see the module)."""
    return HELPERS.start(call, *args, name=name)
