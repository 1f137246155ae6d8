"""End to end: a Ray job (`launcher: ray`) on a fixed-size cluster of 2 nodes (two agents on one
LiveStack, CPU only), ray from a cached environment built once (real uv, real ray from the
index): the driver's actors need a GPU each, so they land on both nodes; after the job, after
a cancel of a running one and after its max runtime, no raylet or gcs_server process is left."""

import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.livestack import UNSANDBOXED, LiveStack

pytestmark = pytest.mark.e2e

RAY = ["ray==2.60.0"]
DONE = ("succeeded", "failed", "cancelled")
RAY_PROCESSES = ("raylet", "gcs_server")

DRIVER = """
    import os, sys, ray
    ray.init()  # RAY_ADDRESS from Hangar
    print("driver up", flush=True)

    @ray.remote(num_gpus=1)  # each node offers 1 GPU: the two actors need both nodes
    class Where:
        def where(self):
            return ray.get_runtime_context().get_node_id(), os.environ["HANGAR_RANK"], os.environ["HANGAR_NODE"]

    actors = [Where.remote() for _ in range(2)]
    for node_id, rank, node in ray.get([a.where.remote() for a in actors]):
        print(f"ran on ray node {node_id[:12]} rank {rank} node {node}", flush=True)
    print("alive", sum(n["Alive"] for n in ray.nodes()), flush=True)
    sys.exit(int(os.environ.get("EXIT", "0")))
"""
SLEEPER = """
    import ray, time
    ray.init()
    print("driver up", flush=True)
    time.sleep(600)
"""


# Ray's environment (~240 MiB, most of this module's time when built) is built once per machine:
# a cache outside the stack's data directory, which a later run finds complete (agent/envcache.py).
RAY_ENV_CACHE = Path(tempfile.gettempdir()) / "hangar-e2e-ray-envs"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env = {
        **UNSANDBOXED,
        "HANGAR_SIM_GPUS": "1",
        "HANGAR_SCHEDULER_INTERVAL": "0.5",
        "HANGAR_ENV_CACHE_DIR": str(RAY_ENV_CACHE),
    }
    with LiveStack(data_dir=str(tmp_path_factory.mktemp("ray")), env=env) as stack:
        stack.start_agent("node-b", gpus=1)
        yield stack


def ray_job(stack: LiveStack, body: str, **fields) -> dict:
    code = textwrap.dedent(body)
    return stack.submit(["python", "-c", code], requirements=RAY, launcher="ray", nodes=2, **fields)


def lines_of(stack: LiveStack, job_id: int) -> list[dict]:
    return stack.api("GET", f"/api/v1/jobs/{job_id}/logs/?limit=5000").json()["lines"]


def ray_processes() -> list[str]:
    """Live (not zombie) raylet and gcs_server processes of Hangar's Ray jobs on this machine."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        name, state = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2]
        if state != "Z" and name in RAY_PROCESSES and "hangar-ray-" in cmdline:
            found.append(f"{stat.parent.name} {name}")
    return found


def no_ray_process_left(within: float = 20) -> list[str]:
    """Every rank's Ray processes end with its process group: a rank learns its attempt ended
    from the next look at the row, then SIGTERM, a grace of HANGAR_KILL_GRACE_SECONDS, SIGKILL."""
    deadline = time.monotonic() + within
    while (left := ray_processes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def test_a_ray_job_on_two_nodes_runs_its_driver_with_both(stack):
    job = ray_job(stack, DRIVER, gpus_per_node=1)
    done = stack.wait_for(job["id"], DONE, timeout=300)
    lines = lines_of(stack, job["id"])
    texts = [line["text"] for line in lines]
    assert done["state"] == "succeeded", texts[-40:]
    assert len(done["attempts"]) == 1  # no requeue hides a cluster that did not form

    ran = sorted(text for text in texts if text.startswith("ran on ray node"))
    assert len(ran) == 2 and {text.split()[6] for text in ran} == {"0", "1"}, ran
    assert {text.split()[8] for text in ran} == {"node-a", "node-b"}
    assert len({text.split()[4] for text in ran}) == 2  # two Ray nodes
    assert "alive 2" in texts
    assert any(text.startswith("[hangar] ray: 2 of 2 Ray nodes joined") for text in texts)
    # Ray's own output of each rank is that rank's output in the job's log.
    assert any(line["rank"] == 1 and "Ray runtime started" in line["text"] for line in lines), texts[:40]
    assert done["exit_code"] == 0
    assert no_ray_process_left() == []


def test_the_drivers_exit_code_is_the_attempts_outcome(stack):
    job = ray_job(stack, DRIVER, gpus_per_node=1, env={"EXIT": "3"})
    done = stack.wait_for(job["id"], DONE, timeout=300)
    assert (done["state"], done["failure_class"], done["exit_code"]) == ("failed", "user", 3)
    assert no_ray_process_left() == []


def test_a_cancelled_ray_job_leaves_no_ray_process(stack):
    job = ray_job(stack, SLEEPER, gpus_per_node=1)
    deadline = time.monotonic() + 300
    while not any(line["text"] == "driver up" for line in lines_of(stack, job["id"])):
        assert time.monotonic() < deadline and stack.job(job["id"])["state"] not in DONE
        time.sleep(0.5)
    assert ray_processes()  # the cluster runs

    stack.api("POST", f"/api/v1/jobs/{job['id']}/cancel/", json={"reason": "enough"})
    assert stack.wait_for(job["id"], DONE, timeout=60)["state"] == "cancelled"
    assert no_ray_process_left() == []


def test_a_ray_job_past_its_max_runtime_is_stopped_with_its_cluster(stack):
    # Long enough for Ray's cluster and driver to be up before the stop, on a slow machine too
    # (at 45 s one run was stopped before its driver printed).
    job = ray_job(stack, SLEEPER, gpus_per_node=1, max_runtime_seconds=90)
    done = stack.wait_for(job["id"], DONE, timeout=240)
    assert (done["state"], done["failure_class"]) == ("failed", "timeout")
    assert any(line["text"] == "driver up" for line in lines_of(stack, job["id"]))  # it ran until stopped
    assert no_ray_process_left() == []
