"""Evidence-backed cordons and diagnosis end to end: a real embedded stack with two simulated nodes
(node-a, node-b), jobs of two members of the project, real processes (a 2-rank gloo job with CPU torch).

A line a job prints is a suspicion: it no longer cordons a node by itself. The driver's own report (an
injected fault), or the same report from jobs of two users on one node, does. Every failed attempt
carries a diagnosis; a rank that goes silent is flagged as a suspected hang.
"""

import sys
import textwrap
import time

import httpx
import pytest

from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e

FAST = {
    "HANGAR_HEARTBEAT_SECONDS": "0.5",
    "HANGAR_NODE_OFFLINE_SECONDS": "8",
    "HANGAR_LEASE_SECONDS": "8",
    "HANGAR_SCHEDULER_INTERVAL": "0.5",
    "HANGAR_KILL_GRACE_SECONDS": "1",
    "HANGAR_CORROBORATION_USERS": "2",
    "HANGAR_HANG_SECONDS": "4",
    "HANGAR_RENDEZVOUS_SECONDS": "20",
}
XID = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
NCCL = "host:1:2 [0] NCCL WARN Call to ibv_post_send failed: unhandled system error"
FINAL = ("succeeded", "failed", "cancelled")

USERS = """
from django.contrib.auth import get_user_model
from portal.models import ApiToken, Membership, Project
project = Project.objects.get(slug="default")
for name in ("alice", "bob"):
    user, _ = get_user_model().objects.get_or_create(username=name)
    Membership.objects.get_or_create(project=project, user=user, defaults={"role": "member"})
    print("token", name, ApiToken.issue(user, "e2e")[1])
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LiveStack(env=FAST, data_dir=str(tmp_path_factory.mktemp("diagnosis"))) as live:
        live.start_agent("node-b", gpus=4, model="H100")
        printed = live.manage("shell", "-c", USERS).splitlines()
        live.tokens = dict(line.split()[1:] for line in printed if line.startswith("token "))
        yield live


def as_user(stack, user: str, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.tokens[user]}"}
    return httpx.request(method, stack.url + path, headers=headers, timeout=30, **kwargs)


def submit(stack, user: str, code: str, **fields) -> dict:
    body = {"project": "default", "command": [sys.executable, "-c", textwrap.dedent(code)], **fields}
    response = as_user(stack, user, "POST", "/api/v1/jobs/", json=body)
    assert response.status_code == 201, response.text
    return response.json()


def node(stack, name: str) -> dict:
    return stack.api("GET", f"/api/v1/nodes/{name}/").json()


def events(stack, name: str) -> list[dict]:
    return stack.api("GET", f"/api/v1/nodes/{name}/events/").json()["results"]


def operate(stack, name: str, action: str, reason: str, override: bool = False) -> None:
    response = stack.api("POST", f"/api/v1/nodes/{name}/{action}/", json={"reason": reason, "override": override})
    assert response.status_code == 200, (name, action, response.json())


def wait_until(predicate, timeout: float, what: str, stack) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    log = (stack.data_dir / "agent-node-b.log").read_text(errors="replace")[-4000:]
    raise AssertionError(f"timed out waiting for {what}\n{stack.output()[-6000:]}\n--- node-b ---\n{log}")


def finished(stack, job_id: int, timeout: float = 90) -> dict:
    job = stack.wait_for(job_id, FINAL, timeout=timeout)
    if job["state"] == "failed":  # its diagnosis is written once the end is committed
        wait_until(lambda: stack.job(job_id)["diagnosis"] is not None, 10, f"job {job_id}'s diagnosis", stack)
        job = stack.job(job_id)
    return job


def reset(stack) -> None:
    for name in ("node-a", "node-b"):
        stack.manage("inject_fault", name, "clear")
    for name in ("node-a", "node-b"):
        if node(stack, name)["state"] != "ready":
            operate(stack, name, "uncordon", "test reset", override=True)
        wait_until(lambda n=name: node(stack, n)["state"] == "ready", 20, f"{name} ready", stack)


def reported(stack, name: str, job_id: int) -> list[dict]:
    """The health events on a node that came from this job's output."""
    attempts = {a["id"] for a in stack.job(job_id)["attempts"]}
    return [e for e in events(stack, name) if e["attempt"] in attempts]


def only_on(stack, name: str):
    """Hold the other node (cordon it by hand) so the next job lands on `name`."""
    other = "node-b" if name == "node-a" else "node-a"
    operate(stack, other, "cordon", "held by the test")
    return lambda: operate(stack, other, "uncordon", "released by the test")


def test_a_printed_xid_and_nccl_error_leave_the_node_ready_and_the_job_fails_as_its_own(stack):
    reset(stack)
    release = only_on(stack, "node-a")
    faker = submit(stack, "alice", f"print({XID!r}, flush=True)\nprint({NCCL!r}, flush=True)\nraise SystemExit(3)")
    wait_until(lambda: reported(stack, "node-a", faker["id"]), 30, "alice's suspicion", stack)
    release()
    done = finished(stack, faker["id"])

    assert done["state"] == "failed" and done["failure_class"] == "user", done
    assert {n: node(stack, n)["state"] for n in ("node-a", "node-b")} == {"node-a": "ready", "node-b": "ready"}
    suspicions = [e for e in events(stack, "node-a") + events(stack, "node-b") if e["source"] == "output"]
    assert suspicions and all("suspected" in e["action"] for e in suspicions)
    assert all("not cordoned" in e["evidence"]["decision"] for e in suspicions)
    assert done["diagnosis"]["confidence"] == "low"  # the job's own claim, never presented as fact

    # Another user's job still lands on node-a and runs there.
    release = only_on(stack, "node-a")
    other = submit(stack, "bob", "print('fine', flush=True)")
    done_other = finished(stack, other["id"])
    release()
    assert done_other["state"] == "succeeded" and done_other["attempts"][0]["node"] == "node-a"


def test_a_printed_xid_plus_the_drivers_own_report_cordons_naming_both(stack):
    reset(stack)
    release = only_on(stack, "node-a")
    job = submit(stack, "alice", f"import time\nprint({XID!r}, flush=True)\ntime.sleep(60)")
    wait_until(lambda: reported(stack, "node-a", job["id"]), 30, "alice's suspicion", stack)
    gpu = stack.job(job["id"])["attempts"][0]["gpu_indices"][0]
    assert node(stack, "node-a")["state"] == "ready"

    stack.manage("inject_fault", "node-a", "xid", "--gpu", str(gpu), "--xid", "79")
    wait_until(lambda: node(stack, "node-a")["state"] == "cordoned", 20, "node-a cordoned", stack)
    release()

    reason = node(stack, "node-a")["state_reason"]
    assert f"GPU {gpu}: Xid 79" in reason and "Xid 79 in the job's output (output" in reason
    stack.api("POST", f"/api/v1/jobs/{job['id']}/cancel/", json={"reason": "test done"})


def test_two_users_jobs_reporting_the_same_nccl_error_on_one_node_cordon_it(stack):
    reset(stack)
    code = f"print({NCCL!r}, flush=True)\nraise SystemExit(1)"
    release = only_on(stack, "node-a")
    first = submit(stack, "alice", code)
    wait_until(lambda: reported(stack, "node-a", first["id"]), 30, "alice's report", stack)
    release()
    finished(stack, first["id"])
    assert node(stack, "node-a")["state"] == "ready"  # one user's report is a suspicion

    release = only_on(stack, "node-a")
    second = submit(stack, "bob", code)
    wait_until(lambda: node(stack, "node-a")["state"] == "cordoned", 30, "node-a cordoned", stack)
    release()
    done = finished(stack, second["id"])

    assert "jobs of 2 different users reported it here" in node(stack, "node-a")["state_reason"]
    first_attempt = done["attempts"][0]  # ended by the corroborated fault: the node's, not bob's
    assert first_attempt["failure_class"] == "infra", first_attempt
    assert first_attempt["diagnosis"]["category"] == "network_error", first_attempt
    assert node(stack, "node-b")["state"] == "ready"


GLOO = """
import os, time
from datetime import timedelta
import torch
import torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
print(f"rank {rank} joined", flush=True)
if rank == 1:
    time.sleep(1)
    raise ValueError("rank 1 cannot read its shard")
t = torch.ones(4)
dist.all_reduce(t)
"""


def test_a_gloo_job_whose_rank_1_fails_names_rank_1_first(stack):
    reset(stack)
    job = submit(stack, "alice", GLOO, nodes=2, gpus_per_node=1)
    done = finished(stack, job["id"], timeout=120)

    assert done["state"] == "failed", done
    found = done["diagnosis"]
    assert found["category"] == "python_exception" and found["first_failing_rank"] == 1, found
    assert "ValueError: rank 1 cannot read its shard" in found["summary"]
    assert found["evidence"][0]["rank"] == 1 and found["evidence"][0]["seq"] > 0
    assert done["attempts"][-1]["diagnosis"] == found
    assert {n: node(stack, n)["state"] for n in ("node-a", "node-b")} == {"node-a": "ready", "node-b": "ready"}


SILENT = """
import os, time
rank = int(os.environ["RANK"])
for i in range(200):
    if rank == 0:
        print(f"step {i}", flush=True)
    time.sleep(0.2)
"""


def test_a_rank_silent_while_the_other_prints_is_flagged_as_a_suspected_hang(stack):
    reset(stack)
    job = submit(stack, "alice", SILENT, nodes=2, gpus_per_node=1)
    stack.wait_for(job["id"], ("running",), timeout=60)

    wait_until(lambda: stack.job(job["id"])["hang_suspected"] is not None, 30, "the hang flag", stack)
    hang = stack.job(job["id"])["hang_suspected"]
    assert hang["ranks"] == [1] and "silent" in hang["summary"]
    assert stack.job(job["id"])["state"] == "running"  # stop_on_hang is off by default
    stack.api("POST", f"/api/v1/jobs/{job['id']}/cancel/", json={"reason": "test done"})

    stopping = submit(stack, "alice", SILENT, nodes=2, gpus_per_node=1, stop_on_hang=True)
    done = finished(stack, stopping["id"], timeout=60)
    assert done["state"] == "failed" and done["diagnosis"]["category"] == "hang", done
