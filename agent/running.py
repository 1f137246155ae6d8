"""What this agent process is: its Agent (CURRENT, once it registered its node) and the
attempts it is running, by id. The heartbeat, the preflight, the output watcher and the
shutdown hook reach them here."""

import threading

CURRENT = None  # agent.node.Agent
RUNNING: dict[int, object] = {}  # attempt id -> agent.runner.Runner
lock = threading.Lock()


def running() -> list:
    with lock:
        return list(RUNNING.values())
