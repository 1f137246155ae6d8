"""A Ray job (`launcher: ray`): the attempt's ranks form a fixed-size Ray cluster, and rank 0
runs the job's command as its driver.

Every rank's process is a Ray node started with `ray start --block` from the job's own
environment (its cached environment has ray), so the raylet, the GCS and the workers stay in
the rank's process group: the runner's SIGTERM, grace, SIGKILL of the group (cancel,
preemption, max runtime, the attempt ended by another rank) ends every Ray process, and their
output is the rank's output, in the job's log under its rank.

Each rank's process is a small wrapper run by the environment's python. It first checks the
ray that `ray start` would import (`RAY_CHECK`): one older than RAY_MINIMUM ignores
RAY_AUTH_MODE=token, and its cluster would take any other job's connection on the node, so the
rank ends at once with exit code 126 (127: no ray at all), the job's failure, saying what to ask
for. Rank 0's wrapper (`HEAD_WRAPPER`) then starts the head, waits for the agent's word that
every node joined, and execs the driver, so the attempt's outcome is the driver's exit code.
The agent decides the join (`join_decision` over what `JOIN_WATCHER` reads from the GCS)
and records it as the `ray-join` check with its evidence. The watcher runs the job's own ray,
so it runs as the job does (its uid, its sandbox: `confine`), and what it reports is the job's word: a cluster
that does not form fails the attempt, and makes no node a suspect (the nodes' reachability
is the rendezvous check's, which Hangar's own agents make before Ray starts).

Ports: each attempt has a block of PORT_BLOCK ports from HANGAR_RAY_PORT_BASE, chosen by its
MASTER_PORT (attempt id mod SLOTS): the GCS at the block's start and the dashboard's (which
Ray starts without its web UI) after it, then RANK_PORTS for each rank (so two ranks on one
host never meet). Workers bind ports the kernel picks. Every one of them asks for the
attempt's token (tests/test_e2e_ray.py tries them from another job).
"""

import hashlib
import hmac
import json
import os
import re
import select
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from jobs.jobspec import RAY_MINIMUM

PORT_BLOCK = 100
SLOTS = 100
RANK_BASE = 10  # offset of rank 0's own ports in the block
RANK_PORTS = 6
RANK_SLOTS = (PORT_BLOCK - RANK_BASE) // RANK_PORTS  # 15: ranks past it reuse a slot (mod), on other hosts
GO_FILE = ".hangar-ray-go"
STATUS_SECONDS = 15.0

TOO_OLD, NO_RAY = 126, 127  # RAY_CHECK's exit codes: the runner counts both as the job's failure

# Every rank first: the version of the ray that `ray start` imports (a console script: the
# working directory is not on its path), read from its _version.py without running it. Ray
# before RAY_MINIMUM (argv[1]) ignores the token; a pre-release of the minimum counts as older.
RAY_CHECK = """\
import importlib.util, os, re, sys
sys.path = [p for p in sys.path if p not in ("", os.getcwd())]

def ray_version():
    spec = importlib.util.find_spec("ray")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        try:
            with open(os.path.join(folder, "_version.py")) as f:
                found = re.search(r'^version = "([^"]+)"', f.read(), re.M)
        except OSError:
            continue
        return (found.group(1) if found else "unknown"), folder
    return ("unreadable", folders[0]) if folders else (None, None)

def older(version, minimum):
    found = re.match(r"(\\d+(?:\\.\\d+)*)(.*)$", version)
    if not found:
        return True
    have, need = [int(n) for n in found.group(1).split(".")], [int(n) for n in minimum.split(".")]
    width = max(len(have), len(need))
    have, need = have + [0] * (width - len(have)), need + [0] * (width - len(need))
    return have < need or (have == need and re.match(r"[.-]?(a|b|c|rc|alpha|beta|pre|preview|dev)", found.group(2)))

minimum = sys.argv[1]
version, where = ray_version()
if version is None:
    print(f"no ray in this job's environment ({sys.executable}): launcher ray needs ray>={minimum}; add it to "
          "requirements", file=sys.stderr, flush=True)
    sys.exit(127)
if older(version, minimum):
    print(f"ray {version} in this job's environment ({where}) is older than {minimum}, the first that enforces "
          "RAY_AUTH_MODE=token: its cluster would take any other job's connection on this node, so it is not "
          f"started; ask for ray>={minimum} in requirements", file=sys.stderr, flush=True)
    sys.exit(126)
"""

# Ranks >= 1: their node, once the check passed.
NODE_WRAPPER = (
    RAY_CHECK
    + """\
import json
node = json.loads(sys.argv[2])
os.execvp(node[0], node)
"""
)

# Rank 0: start the head, wait for the go file (the agent writes it once every node joined),
# then become the driver. A head that dies first ends the rank with its exit code.
HEAD_WRAPPER = (
    RAY_CHECK
    + """\
import json, subprocess, time
go, head_argv, driver = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:]
head = subprocess.Popen(head_argv)
while not os.path.exists(go):
    if head.poll() is not None:
        print(f"ray head exited with code {head.returncode} before every node joined", file=sys.stderr, flush=True)
        sys.exit(head.returncode or 1)
    time.sleep(0.05)
os.remove(go)
os.execvp(driver[0], driver)
"""
)


@dataclass(frozen=True)
class Ports:
    gcs: int
    dashboard: int
    node_manager: int
    object_manager: int
    dashboard_agent_listen: int
    dashboard_agent_grpc: int
    runtime_env_agent: int
    metrics_export: int


def ports(master_port: int, master_base: int, ray_base: int, rank: int) -> Ports:
    """The Ray ports of one rank of the attempt whose MASTER_PORT is `master_port`."""
    block = ray_base + (master_port - master_base) % SLOTS * PORT_BLOCK
    own = block + RANK_BASE + rank % RANK_SLOTS * RANK_PORTS
    return Ports(block, block + 1, *range(own, own + RANK_PORTS))


def port_range(ray_base: int) -> tuple[int, int]:
    """Every port a Ray job of this fleet may listen on (the range to open between GPU hosts)."""
    return ray_base, ray_base + SLOTS * PORT_BLOCK - 1


def auth_token(secret_key: str, attempt_id: int) -> str:
    """The attempt's Ray token (RAY_AUTH_TOKEN): every node and the driver need it to talk to
    the cluster, another job on the host cannot. Each agent derives it from the key they share."""
    return hmac.new(secret_key.encode(), f"hangar-ray {attempt_id}".encode(), hashlib.sha256).hexdigest()


def temp_dir(attempt_id: int, rank: int, token: str) -> str:
    """Ray's session directory. Short: Ray's unix sockets live under it (a path limit of 107)."""
    return f"/tmp/hangar-ray-{attempt_id}-{rank}-{token[:8]}"


def cpu_share(cpus: int, gpus: int, node_gpus: int) -> int:
    """The CPUs a rank offers Ray: the node's share that goes with its GPUs (all of a GPU-less node's)."""
    if gpus <= 0 or node_gpus <= 0:
        return max(1, cpus)
    return max(1, cpus * min(gpus, node_gpus) // node_gpus)


def start_argv(rank: int, p: Ports, head_addr: str, node_addr: str, gpus: int, cpus: int, tmp: str) -> list[str]:
    """`ray start --block` for one rank: the head on rank 0, a node joining it elsewhere."""
    argv = ["ray", "start", "--block", "--disable-usage-stats", f"--node-ip-address={node_addr}"]
    argv += [f"--num-gpus={gpus}", f"--num-cpus={cpus}", f"--resources={json.dumps({f'hangar_rank_{rank}': 1})}"]
    argv += [
        f"--node-manager-port={p.node_manager}",
        f"--object-manager-port={p.object_manager}",
        f"--dashboard-agent-listen-port={p.dashboard_agent_listen}",
        f"--dashboard-agent-grpc-port={p.dashboard_agent_grpc}",
        f"--runtime-env-agent-port={p.runtime_env_agent}",
        f"--metrics-export-port={p.metrics_export}",
        "--min-worker-port=0",
        "--max-worker-port=0",
        f"--temp-dir={tmp}",
    ]
    if rank == 0:
        # Ray starts a dashboard process without the web UI anyway: on the attempt's own port, not 8265.
        return [*argv, "--head", f"--port={p.gcs}", "--include-dashboard=false", f"--dashboard-port={p.dashboard}"]
    return [*argv, f"--address={head_addr}:{p.gcs}"]


def rank_argv(rank: int, start: list[str], command: list[str]) -> list[str]:
    """What a rank's process runs: the ray check, then on rank 0 the head and the driver, on
    the others their node."""
    if rank != 0:
        return ["python", "-c", NODE_WRAPPER, RAY_MINIMUM, json.dumps(start)]
    return ["python", "-c", HEAD_WRAPPER, RAY_MINIMUM, GO_FILE, json.dumps(start), *command]


def exit_hint(code: int) -> str:
    """What a rank's exit code says of its environment (the check's message is in its output)."""
    if code == TOO_OLD:
        return f": its ray is older than {RAY_MINIMUM} and ignores RAY_AUTH_MODE=token; ask for ray>={RAY_MINIMUM}"
    if code == NO_RAY:
        return f": no ray in its environment; ask for ray>={RAY_MINIMUM} in requirements"
    return ""


def ray_env(token: str, head_addr: str, p: Ports) -> dict[str, str]:
    """Added to every rank's environment (the driver's RAY_ADDRESS among them)."""
    return {
        "RAY_ADDRESS": f"{head_addr}:{p.gcs}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "RAY_USAGE_STATS_ENABLED": "0",
    }


# Rank 0's agent watches the cluster form with this, run by the environment's python: the GCS's
# node table, a line a quarter second (`ray status` takes seconds of CPU a call and lags behind
# it). GcsClient is what `ray status` itself uses; where it is missing the agent falls back to
# `ray status` (exit code 3).
JOIN_WATCHER = """\
import json, sys, time
try:
    from ray._raylet import GcsClient
    client = GcsClient(address=sys.argv[1])
except (ImportError, AttributeError, TypeError) as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
    sys.exit(3)
while True:
    try:
        alive = [n for n in client.get_all_node_info(timeout=5).values() if n.state == 0]
        ranks = [int(k[12:]) for n in alive for k in n.resources_total if k.startswith("hangar_rank_")]
        print(json.dumps({"alive": len(alive), "ranks": sorted(ranks)}), flush=True)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {str(exc)[:300]}"}), flush=True)
    time.sleep(0.25)
"""


def watched(line: str) -> tuple[int, set[int], str]:
    """(alive nodes, the ranks among them, error) from one line of JOIN_WATCHER."""
    try:
        seen = json.loads(line)
    except ValueError:
        return 0, set(), f"unreadable: {line[:200]!r}"
    if not isinstance(seen, dict):
        return 0, set(), f"unreadable: {line[:200]!r}"
    return int(seen.get("alive", 0)), set(seen.get("ranks", [])), str(seen.get("error", ""))


ACTIVE_NODE = re.compile(r"^\s*(\d+)\s+node_[0-9a-f]+\s*$")


def active_nodes(status: str) -> int:
    """Nodes `ray status` lists as active (its "Active:" section, one line per node)."""
    count, inside = 0, False
    for line in status.splitlines():
        if line.strip() == "Active:":
            inside = True
        elif inside and (match := ACTIVE_NODE.match(line)):
            count += int(match.group(1))
        elif inside:
            inside = False
    return count


RANK_RESOURCE = re.compile(r"^\s*[\d.]+/[\d.]+\s+hangar_rank_(\d+)\s*$")


def joined_ranks(status: str) -> set[int]:
    """The ranks whose Ray node the cluster holds (each offers its `hangar_rank_<r>` resource)."""
    return {int(m.group(1)) for line in status.splitlines() if (m := RANK_RESOURCE.match(line))}


@dataclass(frozen=True)
class Join:
    done: bool  # stop looking
    passed: bool
    evidence: str


def join_decision(seen: int, expected: int, elapsed: float, limit: float, last_error: str) -> Join:
    """Whether the cluster is complete, still forming, or failed to form within `limit` seconds."""
    if seen >= expected:
        return Join(True, True, f"{seen} of {expected} Ray nodes joined in {elapsed:.1f} s")
    if elapsed < limit:
        return Join(False, False, "")
    why = f"; last ray status: {last_error}" if last_error else ""
    missing = "the head never answered" if seen == 0 else f"only {seen} of {expected} Ray nodes joined"
    return Join(True, False, f"{missing} within {limit:g} s{why}")


@contextmanager
def job_directory(workdir: Path) -> Iterator[int]:
    """The job's own directory as a descriptor: root makes and removes the go file in it through
    this, never through a path whose links the job could swap (O_NOFOLLOW: a link is refused)."""
    directory = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        yield directory
    finally:
        os.close(directory)


def signal_go(workdir: Path) -> None:
    """Let the driver start: the go file (a link the job put in its place is refused)."""
    with job_directory(workdir) as directory:
        os.close(os.open(GO_FILE, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644, dir_fd=directory))


def clean_up(workdir: Path, tmp: str) -> None:
    """After the rank's process group is gone: its go file, and Ray's session directory (on the
    host when the job ran unsandboxed; a sandbox's /tmp went with it; rmtree works through
    descriptors and follows no link)."""
    with suppress(OSError), job_directory(workdir) as directory:
        os.unlink(GO_FILE, dir_fd=directory)
    shutil.rmtree(tmp, ignore_errors=True)


# Runs a helper as the job's own processes run: (argv, env) -> (argv, env, Popen's user arguments).
Confine = Callable[[list[str], dict[str, str]], tuple[list[str], dict[str, str], dict]]


def unconfined(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str], dict]:
    return argv, env, {}


class Watch:
    """What the cluster holds now, as JOIN_WATCHER reports it (or `ray status`, where it cannot).
    Both run the job's environment's python and ray, so `confine` runs them as the job."""

    def __init__(self, bin_dir: Path | None, env: dict[str, str], address: str, confine: Confine = unconfined):
        self.bin_dir, self.env, self.address, self.confine = bin_dir, env, address, confine
        python = str(bin_dir / "python") if bin_dir is not None else "python"
        argv, env, user = confine([python, "-c", JOIN_WATCHER, address], env)
        self.proc = subprocess.Popen(
            argv,
            env=env,
            **user,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.buffer = b""
        self.last: tuple[int, set[int], str] = (0, set(), "")
        self.fallback = False

    def look(self, timeout: float) -> tuple[int, set[int], str]:
        """(alive nodes, their ranks, error): the latest report within `timeout` seconds."""
        if not self.fallback:
            fd = self.proc.stdout.fileno()
            if select.select([fd], [], [], timeout)[0]:
                chunk = os.read(fd, 65536)
                self.buffer += chunk
                *lines, self.buffer = self.buffer.split(b"\n")
                if lines:
                    self.last = watched(lines[-1].decode(errors="replace"))
                if chunk:
                    return self.last
            if self.proc.poll() is None:
                return self.last
            self.fallback = True  # no GcsClient in this ray: ask `ray status`
        text, error = status(self.bin_dir, self.env, self.address, self.confine)
        return active_nodes(text), joined_ranks(text), error or self.last[2]

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def status(
    prefix_bin: Path | None, env: dict[str, str], address: str, confine: Confine = unconfined
) -> tuple[str, str]:
    """(`ray status`'s text, error text) of the cluster at `address`."""
    ray = str(prefix_bin / "ray") if prefix_bin is not None else "ray"
    argv, env, user = confine([ray, "status", f"--address={address}"], env)
    try:
        done = subprocess.run(
            argv,
            env=env,
            **user,
            capture_output=True,
            text=True,
            timeout=STATUS_SECONDS,
            start_new_session=True,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "", f"{type(exc).__name__}: {exc}"
    if done.returncode != 0:
        tail = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()][-1:]
        return "", f"exit code {done.returncode}: {tail[0][:300] if tail else 'no output'}"
    return done.stdout, ""


# --- the head refuses a client without the token ------------------------------------------------

UNAUTHENTICATED = 16  # gRPC's status for a call without valid credentials
GCS_CALL = "/ray.rpc.NodeInfoGcsService/GetAllNodeInfo"


def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def grpc_request(host: str, port: int, path: str) -> bytes:
    """One unary call with an empty message and no credentials, as HTTP/2 bytes: the preface,
    SETTINGS, HEADERS (HPACK literals, no Huffman coding) and the message."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"{host}:{port}")]
    headers += [("content-type", "application/grpc"), ("te", "trailers")]
    block = b"".join(b"\0" + bytes([len(k)]) + k.encode() + bytes([len(v)]) + v.encode() for k, v in headers)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0)
    return preface + h2_frame(1, 4, 1, block) + h2_frame(0, 1, 1, b"\0" * 5)


GRPC_STATUS = re.compile(rb"grpc-status[\x00-\x7f](\d+)")


def tokenless_status(host: str, port: int, timeout: float = 5.0) -> tuple[int | None, str]:
    """(grpc-status, evidence) of a call to the GCS at host:port without the token: the agent's
    own look at whether the cluster is closed (UNAUTHENTICATED), whatever the job's ray says of
    itself. Framed by hand: the agent has no gRPC client, and the job's (its ray, its grpcio)
    would be the job's word again. gRPC's C core writes its trailers as plain literals."""
    got, deadline = b"", time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(grpc_request(host, port, GCS_CALL))
            while not GRPC_STATUS.search(got) and time.monotonic() < deadline and len(got) < 1 << 20:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    found = GRPC_STATUS.search(got)
    if found is None:
        return None, f"no grpc-status in {len(got)} bytes"
    return int(found.group(1)), f"grpc-status {int(found.group(1))}"
