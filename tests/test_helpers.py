"""agent/helpers.py: the runners' helper threads, kept and reused."""

import threading

from agent.helpers import IDLE_NAME, Helpers


def ran_on(helpers: Helpers, name: str = "helper-test") -> tuple[int, str]:
    """Run one call on a helper and wait for it: the thread it ran on, and that thread's name then."""
    seen, done = {}, threading.Event()

    def call():
        seen["thread"], seen["name"] = threading.get_ident(), threading.current_thread().name
        done.set()

    helpers.start(call, name=name)
    assert done.wait(5)
    return seen["thread"], seen["name"]


def wait_idle(helpers: Helpers, count: int) -> None:
    for _ in range(500):
        with helpers.lock:
            if len(helpers.idle) == count:
                return
        threading.Event().wait(0.01)
    raise AssertionError(f"{len(helpers.idle)} helpers idle, not {count}")


def test_a_call_after_another_runs_on_the_thread_that_finished_it():
    helpers = Helpers()
    first, name = ran_on(helpers, "lease-7-0")
    assert name == "lease-7-0"  # named for its call while it runs, as a thread of its own was
    wait_idle(helpers, 1)
    second, _ = ran_on(helpers)
    assert second == first
    wait_idle(helpers, 1)
    assert helpers.idle[0].name == IDLE_NAME and helpers.idle[0].daemon


def test_calls_at_once_each_get_a_thread_and_all_stay_for_later():
    helpers, release = Helpers(), threading.Event()
    started, threads = threading.Barrier(4), set()

    def blocked():
        threads.add(threading.get_ident())
        started.wait(5)  # each waits for the others: they run at once or the barrier breaks
        release.wait(5)

    for number in range(3):
        helpers.start(blocked, name=f"reader-{number}")
    started.wait(5)
    assert len(threads) == 3
    release.set()
    wait_idle(helpers, 3)
    again = {ran_on(helpers)[0] for _ in range(3)}
    assert again <= threads  # no new thread: an idle one took each


def test_a_call_that_raises_is_logged_and_its_thread_serves_the_next(caplog):
    helpers = Helpers()

    def broken(what):
        raise RuntimeError(what)

    helpers.start(broken, "no store", name="mlflow-run")
    wait_idle(helpers, 1)
    assert "mlflow-run failed" in caplog.text and "no store" in caplog.text
    thread = helpers.idle[0].ident
    assert ran_on(helpers)[0] == thread


def test_an_idle_helper_keeps_nothing_of_its_last_call():
    """A reader's last call holds a job's pipe and its writer's queue: an idle helper must not
    keep them alive until its next call."""
    import gc
    import weakref

    class Pipe:
        pass

    helpers, pipe = Helpers(), Pipe()
    gone = weakref.ref(pipe)
    helpers.start(lambda p: None, pipe, name="reader")
    del pipe
    wait_idle(helpers, 1)
    gc.collect()
    assert gone() is None


def test_a_call_can_be_waited_for_as_a_thread_of_its_own_was():
    """A log writer's storer is joined at the writer's end, and the writer asks whether it still
    runs before it waits to hand it a batch."""
    helpers, go = Helpers(), threading.Event()
    running = helpers.start(go.wait, 5, name="logs-7-0-store")
    assert running.is_alive()
    running.join(0.05)
    assert running.is_alive()  # the wait ran out, the call has not ended
    go.set()
    running.join(5)
    assert not running.is_alive()
    with helpers.lock:
        assert len(helpers.idle) == 1  # back before its end was told: the next start takes it
