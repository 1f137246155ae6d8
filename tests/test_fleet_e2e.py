"""Fleet health end to end, in both modes: a real stack with two simulated nodes (node-a, node-b),
faults injected from another process (`manage.py inject_fault`) into the running agents, and a
SIGKILLed agent. The job must land on the healthy node and succeed there, never twice at once.
"""

import os
import signal
import sys
import textwrap
import time

import pytest

from tests.factories import services_database
from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e

FAST = {
    "HANGAR_HEARTBEAT_SECONDS": "0.5",
    # Short enough for the tests to move on, long enough that a loaded machine's late heartbeat is not a lost node.
    "HANGAR_NODE_OFFLINE_SECONDS": "8",
    "HANGAR_LEASE_SECONDS": "8",
    "HANGAR_SCHEDULER_INTERVAL": "0.5",
    "HANGAR_KILL_GRACE_SECONDS": "1",
}

# The first attempt runs until it is stopped; any later attempt succeeds at once.
FIRST_ATTEMPT_HANGS = textwrap.dedent(
    """
    import os, time
    if os.environ["HANGAR_ATTEMPT"] == "1":
        for i in range(600):
            print(f"step {i}", flush=True)
            time.sleep(0.2)
    print("done on", os.environ["HANGAR_NODE"], flush=True)
    """
)
SHORT = "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.5)\n"


@pytest.fixture(scope="module", params=["embedded", "services"])
def stack(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(f"fleet-{request.param}")
    if request.param == "embedded":
        with LiveStack(env=FAST, data_dir=str(data_dir)) as live:
            live.start_agent("node-b", gpus=4, model="H100")
            yield live
        return
    services = services_database()
    with services as env, LiveStack(env={**env, **FAST}, data_dir=str(data_dir)) as live:
        live.start_agent("node-b", gpus=4, model="H100")
        yield live


def node(stack, name: str) -> dict:
    return stack.api("GET", f"/api/v1/nodes/{name}/").json()


def operate(stack, name: str, action: str, reason: str, override: bool = False) -> None:
    response = stack.api("POST", f"/api/v1/nodes/{name}/{action}/", json={"reason": reason, "override": override})
    assert response.status_code == 200, (name, action, response.json())


def agent_log(stack) -> str:
    path = stack.data_dir / "agent-node-b.log"
    return path.read_text(errors="replace")[-5000:] if path.exists() else "(no node-b log)"


def wait_until(predicate, timeout: float, what: str, stack) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{stack.output()}\n--- node-b ---\n{agent_log(stack)}")


def finished(stack, job_id: int, timeout: float = 90) -> dict:
    try:
        return stack.wait_for(job_id, ("succeeded", "failed", "cancelled"), timeout=timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- node-b ---\n{agent_log(stack)}") from None


def reset(stack) -> None:
    """Both nodes healthy, ready and heard from."""
    for name in ("node-a", "node-b"):
        stack.manage("inject_fault", name, "clear")
    for name in ("node-a", "node-b"):
        wait_until(lambda n=name: node(stack, n)["last_heartbeat_at"] and node_fresh(stack, n), 20, f"{name}", stack)
        if node(stack, name)["state"] != "ready":
            operate(stack, name, "uncordon", "test reset", override=True)
        wait_until(lambda n=name: node(stack, n)["state"] == "ready", 20, f"{name} ready", stack)


def node_fresh(stack, name: str) -> bool:
    gpus = node(stack, name)["gpus"]
    return all(not g["lost"] and g["ecc_uncorrected_volatile"] == 0 for g in gpus)


def start_on_node_a(stack, code: str) -> dict:
    """Submit while node-b is held, so the job starts on node-a; then release node-b."""
    operate(stack, "node-b", "cordon", "held by the test")
    job = stack.submit([sys.executable, "-c", code], gpus_per_node=2)
    job = stack.wait_for(job["id"], ("running",), timeout=60)
    assert job["attempts"][0]["node"] == "node-a"
    operate(stack, "node-b", "uncordon", "released by the test")
    return job


def events(stack, name: str) -> list[dict]:
    return stack.api("GET", f"/api/v1/nodes/{name}/events/").json()["results"]


@pytest.mark.parametrize(
    ("fault", "extra", "kind"),
    [
        ("xid", ["--xid", "79"], "xid"),
        ("xid", ["--xid", "48"], "xid"),
        ("ecc", [], "ecc"),
        ("gpu_lost", [], "gpu_lost"),
        ("nccl", [], "nccl"),
    ],
)
def test_a_hardware_fault_cordons_the_node_and_the_job_succeeds_elsewhere(stack, fault, extra, kind):
    reset(stack)
    job = start_on_node_a(stack, FIRST_ATTEMPT_HANGS)
    gpu = job["attempts"][0]["gpu_indices"][0]

    stack.manage("inject_fault", "node-a", fault, "--gpu", str(gpu), *extra)
    done = finished(stack, job["id"])

    assert done["state"] == "succeeded", done
    first, *_, last = done["attempts"]
    assert (first["node"], first["state"], first["failure_class"]) == ("node-a", "failed", "infra")
    assert last["node"] == "node-b" and last["state"] == "succeeded"
    assert done["requeues"] == len(done["attempts"]) - 1  # infra requeues, none of the user's retries
    a = node(stack, "node-a")
    assert a["state"] == "cordoned" and a["auto_cordoned"]
    # The node's own report (an injected NCCL failure also reaches the job's output: a suspicion there).
    event = next(e for e in events(stack, "node-a") if e["kind"] == kind and e["source"] == "telemetry")
    assert "cordoned" in event["action"]
    assert event["message"] in a["state_reason"]


@pytest.mark.parametrize(
    ("fault", "extra", "kind"), [("thermal", [], "thermal"), ("power", [], "power"), ("xid", ["--xid", "13"], "xid")]
)
def test_a_soft_fault_is_recorded_and_the_job_finishes_where_it_is(stack, fault, extra, kind):
    reset(stack)
    before = len(events(stack, "node-a"))
    job = start_on_node_a(stack, SHORT)
    gpu = job["attempts"][0]["gpu_indices"][0]

    stack.manage("inject_fault", "node-a", fault, "--gpu", str(gpu), "--seconds", "10", *extra)
    done = finished(stack, job["id"], timeout=60)

    assert done["state"] == "succeeded" and len(done["attempts"]) == 1
    wait_until(lambda: len(events(stack, "node-a")) > before, 10, f"a {kind} event", stack)
    assert events(stack, "node-a")[0]["kind"] == kind
    assert events(stack, "node-a")[0]["action"] == "recorded"
    assert node(stack, "node-a")["state"] == "ready"


def test_a_silent_agent_takes_its_node_offline_and_the_job_moves(stack):
    reset(stack)
    job = start_on_node_a(stack, FIRST_ATTEMPT_HANGS)

    stack.manage("inject_fault", "node-a", "agent_silent", "--seconds", "600")
    done = finished(stack, job["id"])

    assert done["state"] == "succeeded"
    first, last = done["attempts"][0], done["attempts"][-1]
    assert (first["node"], first["state"], first["failure_class"]) == ("node-a", "lost", "infra")
    assert last["node"] == "node-b"
    assert node(stack, "node-a")["state"] == "offline"
    stack.manage("inject_fault", "node-a", "clear")
    wait_until(lambda: node(stack, "node-a")["state"] == "ready", 20, "node-a back after clear", stack)


def test_a_sigkilled_agent_loses_its_attempt_and_the_job_finishes_on_another(stack):
    """Last in this module: node-b's agent does not come back."""
    reset(stack)
    operate(stack, "node-a", "cordon", "held by the test")
    job = stack.submit([sys.executable, "-c", FIRST_ATTEMPT_HANGS], gpus_per_node=1)
    job = stack.wait_for(job["id"], ("running",), timeout=60)
    assert job["attempts"][0]["node"] == "node-b"
    operate(stack, "node-a", "uncordon", "released by the test")

    agent = stack.agents["node-b"]
    os.kill(agent.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    most_live, offline_after = 0, None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        current = stack.job(job["id"])
        most_live = max(
            most_live, sum(a["state"] in ("scheduled", "preflight", "running") for a in current["attempts"])
        )
        if offline_after is None and node(stack, "node-b")["state"] == "offline":
            offline_after = time.monotonic() - killed_at
        if current["state"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.1)
    # The lease may end the attempt (and the job finish elsewhere) before the node is marked offline.
    while offline_after is None and time.monotonic() < deadline:
        if node(stack, "node-b")["state"] == "offline":
            offline_after = time.monotonic() - killed_at
        time.sleep(0.1)

    assert current["state"] == "succeeded", current
    assert most_live <= 1, "two attempts of one job were live at once"
    first, last = current["attempts"][0], current["attempts"][-1]
    assert (first["node"], first["state"], first["failure_class"]) == ("node-b", "lost", "infra")
    assert last["node"] == "node-a" and last["state"] == "succeeded"
    assert node(stack, "node-b")["state"] == "offline"
    assert offline_after is not None and offline_after < 8 + 4  # the offline timeout, plus a reconcile pass and a poll
