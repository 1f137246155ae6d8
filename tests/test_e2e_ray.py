"""End to end: a Ray job (`launcher: ray`) on a fixed-size cluster of 2 nodes (two agents on one
LiveStack, CPU only), ray from a cached environment built once (real uv, real ray from the
index): the driver's actors need a GPU each, so they land on both nodes; after the job, after
a cancel of a running one and after its max runtime, no raylet or gcs_server process is left.
Another job on the same host cannot reach a Ray job's cluster (issue 52), and a rank whose ray
is older than the token's minimum ends as the job's failure before starting it."""

import json
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from agent import ray as raycluster
from tests.livestack import LiveStack

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


# --- another job against a Ray job's cluster (issue 52) ---------------------------------------

# Both jobs' code: one unary gRPC call written by hand on a TCP socket (HTTP/2 preface, SETTINGS,
# HEADERS as HPACK literals, an empty message), read back to grpc-status; and one HTTP GET.
PROBE = r"""
import json, re, socket, time, urllib.error, urllib.request

CALLS = ["/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", "/ray.rpc.NodeManagerService/GetNodeStats",
         "/ray.rpc.ObjectManagerService/Pull", "/ray.rpc.CoreWorkerService/NumPendingTasks"]

def frame(kind, flags, stream, payload=b""):
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

def literal(name, value):
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()

def grpc(host, port, path, token=None):
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"{host}:{port}"),
               ("content-type", "application/grpc"), ("te", "trailers")]
    headers += [("authorization", f"Bearer {token}")] if token else []
    block = b"".join(literal(k, v) for k, v in headers)
    request = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0) + frame(1, 4, 1, block)
    got, deadline = b"", time.monotonic() + 5
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(request + frame(0, 1, 1, b"\x00" * 5))
        while b"grpc-status" not in got and time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            got += chunk
    status = re.search(rb"grpc-status[\x00-\x7f](\d+)", got)
    message = re.search(rb"grpc-message([\x00-\x7f])", got)
    text = got[message.end():message.end() + message.group(1)[0]].decode(errors="replace") if message else ""
    return (int(status.group(1)) if status else None), text or f"{len(got)} bytes"

def http(host, port):
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except Exception as exc:
        return type(exc).__name__

def probe(host, port):
    try:
        calls = {path.split("/")[2]: grpc(host, port, path) for path in CALLS}
    except OSError as exc:
        return "closed", {"tcp": f"{type(exc).__name__}: {exc}"}
    seen = {**calls, "http": http(host, port)}
    if any(status == 0 for status, _ in calls.values()) or seen["http"] == 200:
        return "REACHED", seen
    if any(status == 16 for status, _ in calls.values()) or seen["http"] in (401, 403):
        return "refused", seen
    return "unclear", seen
"""

# Job A: a Ray cluster whose driver checks the probe gets through with the attempt's token (so
# a refusal of B's is the token's doing), then waits for B's word and uses its cluster again.
VICTIM = (
    PROBE
    + """
import os, sys, ray
ray.init()
host, port = os.environ["RAY_ADDRESS"].rsplit(":", 1)
print("A with its token:", json.dumps(grpc(host, int(port), CALLS[0], os.environ["RAY_AUTH_TOKEN"])), flush=True)
listener = socket.create_server(("", 0))
listener.settimeout(240)
print("A waits", json.dumps({"host": host, "gcs": int(port), "signal": listener.getsockname()[1]}), flush=True)
try:
    listener.accept()[0].close()
except socket.timeout:
    sys.exit("A: no word from B")

@ray.remote
def square(x):
    return x * x

print("A after B:", sum(ray.get([square.remote(i) for i in range(4)])), flush=True)
"""
)

# Job B: a plain job on the same host, without A's token: Ray's own client, ray.init, a guessed
# token, then the hand-made call and a GET on every port A's processes listen on.
INTRUDER = (
    PROBE
    + """
import os, sys
target = json.loads(os.environ["TARGET"])
host, gcs = target["host"], target["gcs"]
from ray._raylet import GcsClient
try:
    print("B GcsClient: REACHED", len(GcsClient(address=f"{host}:{gcs}").get_all_node_info(timeout=5)), flush=True)
except Exception as exc:
    print("B GcsClient:", type(exc).__name__, str(exc)[:160], flush=True)
print("B guessed token:", json.dumps(grpc(host, gcs, CALLS[0], "0" * 64)), flush=True)
import ray
try:
    ray.init(address=f"{host}:{gcs}")
    print("B ray.init: REACHED", len(ray.nodes()), flush=True)
except Exception as exc:
    print("B ray.init:", type(exc).__name__, str(exc)[:160], flush=True)
for address, port, name in target["ports"]:
    verdict, seen = probe(address, port)
    print("B port", port, name, verdict, json.dumps(seen), flush=True)
socket.create_connection((host, target["signal"]), timeout=5).close()
print("B told A", flush=True)
"""
)


def texts_of(stack: LiveStack, job_id: int) -> list[str]:
    return [line["text"] for line in lines_of(stack, job_id)]


def wait_for_line(stack: LiveStack, job_id: int, prefix: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [text for text in texts_of(stack, job_id) if text.startswith(prefix)]
        if found:
            return found[0]
        assert stack.job(job_id)["state"] not in DONE, texts_of(stack, job_id)[-40:]
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} printed no {prefix!r} in {timeout} s: {texts_of(stack, job_id)[-40:]}")


def said_after(texts: list[str], prefix: str) -> str:
    return next((text.removeprefix(prefix) for text in texts if text.startswith(prefix)), "(not said)")


def listening(job_id: int) -> list[tuple[str, int, str]]:
    """(address to reach, port, process name) of every TCP port a job's processes listen on,
    found the way only root sees them: their environment names the job, their sockets the port."""
    inodes: dict[str, str] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if f"HANGAR_JOB_ID={job_id}".encode() not in environ:
                continue
            name = (proc / "comm").read_text().strip()
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = name
        except OSError:
            continue
    found = []
    for table, any_address in (("/proc/net/tcp", "0.0.0.0"), ("/proc/net/tcp6", "::")):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # LISTEN
                address, port = local.split(":")
                found.append((hex_address(address, any_address), int(port, 16), inodes[inode]))
    return sorted(set(found), key=lambda seen: seen[1])


def hex_address(text: str, any_address: str) -> str:
    """/proc/net/tcp's little-endian address; a wildcard one is reached on loopback."""
    if len(text) == 8:
        address = ".".join(str(int(text[i : i + 2], 16)) for i in (6, 4, 2, 0))
        return "127.0.0.1" if address == any_address else address
    return "127.0.0.1" if set(text) == {"0"} else "::1" if text.endswith("01000000") else text


def test_another_job_on_the_host_cannot_reach_a_ray_jobs_cluster(stack):
    victim = stack.submit(["python", "-c", textwrap.dedent(VICTIM)], requirements=RAY, launcher="ray", nodes=1)
    waits = json.loads(wait_for_line(stack, victim["id"], "A waits ").removeprefix("A waits "))
    control = wait_for_line(stack, victim["id"], "A with its token: ")
    assert json.loads(control.removeprefix("A with its token: "))[0] == 0  # the probe itself gets through
    assert raycluster.tokenless_status(waits["host"], waits["gcs"])[0] == raycluster.UNAUTHENTICATED  # the agent's look

    # Every port A's processes listen on (less the driver's word port, which B uses at the end),
    # and the dashboard's in the attempt's block (agent/ray.py), listening or not.
    ports = [seen for seen in listening(victim["id"]) if seen[1] != waits["signal"]]
    names = {name for _, _, name in ports}
    assert waits["gcs"] in {port for _, port, _ in ports} and {"gcs_server", "raylet"} <= names, ports
    target = {**waits, "ports": [*ports, (waits["host"], waits["gcs"] + 1, "dashboard")]}
    intruder = stack.submit(
        ["python", "-c", textwrap.dedent(INTRUDER)], requirements=RAY, env={"TARGET": json.dumps(target)}
    )
    done = stack.wait_for(intruder["id"], DONE, timeout=180)
    said = texts_of(stack, intruder["id"])
    print("\n".join(text for text in said if text.startswith("B ")))  # what B got, in the test's output
    assert done["state"] == "succeeded" and "B told A" in said, said[-40:]

    assert said_after(said, "B GcsClient: ").startswith("AuthenticationError"), said
    assert json.loads(said_after(said, "B guessed token: "))[0] == 16  # UNAUTHENTICATED
    assert said_after(said, "B ray.init: ").startswith("ConnectionError"), said
    assert any("Unauthenticated" in text for text in said)  # Ray's own client says why it gave up
    verdicts = {int(text.split()[2]): text.split()[4] for text in said if text.startswith("B port ")}
    assert set(verdicts) == {port for _, port, _ in target["ports"]}, said
    assert verdicts[waits["gcs"]] == "refused" and set(verdicts.values()) <= {"refused", "closed"}, said

    finished = stack.wait_for(victim["id"], DONE, timeout=120)
    assert finished["state"] == "succeeded", texts_of(stack, victim["id"])[-40:]
    assert "A after B: 14" in texts_of(stack, victim["id"])  # A's cluster is as it was
    assert no_ray_process_left() == []


def test_a_ray_job_whose_ray_ignores_the_token_fails_as_the_users_before_its_cluster_starts(stack):
    """The submit refuses such a requirement; the agent checks what the environment really
    imports, here an old ray put first on PYTHONPATH (where `ray start` would take it from)."""
    site = Path(tempfile.mkdtemp(prefix="hangar-old-ray-", dir="/var/tmp"))  # a job uid reads it; /tmp is its own
    try:
        (site / "ray").mkdir()
        (site / "ray" / "__init__.py").write_text("")
        (site / "ray" / "_version.py").write_text('version = "2.40.0"\n')
        for path in (site, site / "ray", *(site / "ray").iterdir()):
            path.chmod(0o755)  # the test's umask may be 077
        job = stack.submit(
            ["python", "-c", "print('driver')"], requirements=RAY, launcher="ray", env={"PYTHONPATH": str(site)}
        )
        done = stack.wait_for(job["id"], DONE, timeout=300)
    finally:
        shutil.rmtree(site)
    texts = texts_of(stack, job["id"])
    assert (done["state"], done["failure_class"], done["exit_code"]) == ("failed", "user", 126), texts[-20:]
    assert len(done["attempts"]) == 1 and "driver" not in texts
    said = [text for text in texts if text.startswith("ray 2.40.0 in this job's environment")]
    assert said and "ask for ray>=2.52.0 in requirements" in said[0], texts[-20:]
    assert not any("Ray runtime started" in text for text in texts) and no_ray_process_left() == []
