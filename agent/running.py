"""What this agent process is: its Agent (CURRENT, once it registered its node) and the
attempts it is running, by id. The heartbeat, the preflight, the output watcher and the
shutdown hook reach them here."""

import threading

CURRENT = None  # agent.node.Agent
RUNNING: dict[int, object] = {}  # attempt id -> agent.runner.Runner
lock = threading.Lock()
# Notified (under `lock`) when a runner leaves RUNNING: its process is gone and its GPUs are
# free, so a rank waiting for them starts at once instead of on its next look.
released = threading.Condition(lock)


def release(attempt_id: int) -> None:
    with lock:
        if RUNNING.pop(attempt_id, None) is not None:
            released.notify_all()


def running() -> list:
    with lock:
        return list(RUNNING.values())
