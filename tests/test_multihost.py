"""A fleet of two real hosts: each agent in its own network namespace (own address on a bridge, own
host name, an /etc/hosts that names neither host), PostgreSQL and Redis reached over the bridge.

What it shows (issue: a fleet of real hosts): a 2-node gloo job meets at rank 0's advertised address
with no host names resolving; a job with a secret and one logging to MLflow run on the second host
with the shared settings, and an agent without them refuses to start; a 45 s partition of one host
loses and reruns the attempt, and every line the cut-off rank printed is stored once; rank 0's node
unreachable makes rank 0's node (not the reporting rank's) the suspect, then cordoned, and the queue
says why. Needs root (network namespaces), like the sandbox tests; everything made is removed after.
"""

import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.livestack import BASE_DIR, POSTGRES_ADMIN_URL, LiveStack, ServicesDatabase, die_with_parent

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (netns)"),
]

SUBNET = f"10.231.{int(uuid.uuid4().hex[:2], 16) % 200 + 20}"
BRIDGE_IP = f"{SUBNET}.1"
HOSTS = {"gpu-a": f"{SUBNET}.2", "gpu-b": f"{SUBNET}.3"}
FORWARDED_PORTS = (5432, 6379)  # PostgreSQL and Redis listen on 127.0.0.1: reached through the bridge


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Forwarder:
    """TCP from the bridge address to the same port on 127.0.0.1: what a database server listening
    on the network would be. Each connection is two pumps; stop() closes everything."""

    def __init__(self, address: str, ports: tuple[int, ...]):
        self.servers = [socket.create_server((address, port)) for port in ports]
        self.open: list[socket.socket] = []
        self.stopped = False
        for server, port in zip(self.servers, ports, strict=True):
            threading.Thread(target=self.accept, args=(server, port), daemon=True).start()

    def accept(self, server: socket.socket, port: int) -> None:
        while not self.stopped:
            try:
                client, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", port))
            except OSError:
                continue
            self.open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self.pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopped = True
        for s in self.servers + self.open:
            s.close()


class Hosts:
    """The bridge, one namespace per host and their private /etc; removed by close(), always."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:4]
        self.bridge = f"hgbr{self.tag}"
        self.made: list[tuple[str, str]] = []

    def ns(self, host: str) -> str:
        return f"hg{self.tag}-{host}"

    def link(self, host: str) -> str:
        return f"hg{self.tag}{host[-1]}"  # the root side of the host's veth

    def build(self) -> "Hosts":
        ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        ip("addr", "add", f"{BRIDGE_IP}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for host, address in HOSTS.items():
            ns, outside = self.ns(host), self.link(host)
            ip("netns", "add", ns)
            self.made.append(("netns", ns))
            etc = Path("/etc/netns") / ns  # `ip netns exec` binds these over /etc: no host is named
            etc.mkdir(parents=True)
            self.made.append(("dir", str(etc)))
            (etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
            ip("link", "add", outside, "type", "veth", "peer", "name", f"{outside}i")
            self.made.append(("link", outside))
            ip("link", "set", outside, "master", self.bridge, "up")
            ip("link", "set", f"{outside}i", "netns", ns)
            ip("-n", ns, "link", "set", f"{outside}i", "name", "eth0")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        return self

    def partition(self, host: str, cut: bool) -> None:
        ip("link", "set", self.link(host), "down" if cut else "up")

    def close(self) -> None:
        for kind, name in reversed(self.made):
            if kind == "dir":
                shutil.rmtree(name, ignore_errors=True)
            else:
                subprocess.run(["ip", kind, "del", name], capture_output=True)


def over_bridge(url: str) -> str:
    return url.replace("127.0.0.1", BRIDGE_IP)


class Fleet:
    def __init__(self, stack: LiveStack, hosts: Hosts, shared: dict[str, str]):
        self.stack, self.hosts, self.shared = stack, hosts, shared
        self.agents: dict[str, subprocess.Popen] = {}

    def agent_env(self, host: str, shared: bool = True, **extra: str) -> dict[str, str]:
        env = {**self.stack.env, "HANGAR_NODE_NAME": host, "HANGAR_SIM_GPUS": "1"}
        env["HANGAR_DATA_DIR"] = str(self.stack.data_dir / host)  # each host its own data directory
        for name in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "MLFLOW_TRACKING_URI"):
            env[name] = over_bridge(env[name])
        if not shared:
            for name in self.shared:
                env.pop(name, None)
        return {**env, **extra}

    def run_agent(self, host: str, env: dict[str, str]) -> subprocess.Popen:
        """`manage.py agent` on the host: in its namespace, with its own host name (a UTS namespace)."""
        python = f"{sys.executable} manage.py agent"
        log = open(self.stack.data_dir / f"agent-{host}.log", "ab")  # noqa: SIM115  (the process keeps it)
        return subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.hosts.ns(host),
                "unshare",
                "--uts",
                "sh",
                "-c",
                f"hostname {host} && exec {python}",
            ],
            cwd=BASE_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def start(self, host: str, **extra: str) -> None:
        self.stop(host)
        registered = f"node {host}: advertises"  # printed once the agent has registered
        before = self.log(host).count(registered)
        proc = self.run_agent(host, self.agent_env(host, **extra))
        self.agents[host] = proc
        deadline = time.monotonic() + 90
        while self.log(host).count(registered) == before or not self.stack._node_ready(host):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"agent {host} did not register (exit {proc.poll()}):\n{self.log(host)[-5000:]}")
            time.sleep(0.2)

    def stop(self, host: str) -> None:
        proc = self.agents.pop(host, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()

    def log(self, host: str) -> str:
        path = self.stack.data_dir / f"agent-{host}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def node(self, name: str) -> dict:
        return self.stack.api("GET", f"/api/v1/nodes/{name}/").json()

    def lines(self, job_id: int) -> list[dict]:
        out, cursor = [], {"attempt": 0, "seq": 0}
        while True:
            params = {"after_attempt": cursor["attempt"], "after_seq": cursor["seq"], "limit": 1000}
            page = self.stack.api("GET", f"/api/v1/jobs/{job_id}/logs/", params=params).json()
            out += page["lines"]
            if not page["lines"]:
                return out
            cursor = page["cursor"]


@pytest.fixture(scope="module")
def fleet():
    services = ServicesDatabase()
    if reason := services.available():
        pytest.skip(reason)
    hosts = Hosts()
    forwarder = stack = None
    mlflow_db = f"{services.name}_mlflow"
    import psycopg

    try:
        hosts.build()
        with services as service_env, psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{mlflow_db}"')
            mlflow_url = POSTGRES_ADMIN_URL.replace("postgresql://", "postgresql+psycopg://").rsplit("/", 1)[0]
            shared = {
                "HANGAR_SECRET_KEY": secrets.token_urlsafe(40),
                "MLFLOW_TRACKING_URI": f"{mlflow_url}/{mlflow_db}",
            }
            env = {
                **service_env,
                **shared,
                "HANGAR_RENDEZVOUS_SECONDS": "4",
                "HANGAR_LEASE_SECONDS": "10",
                "HANGAR_NODE_OFFLINE_SECONDS": "10",
            }
            stack = LiveStack(env=env, local_agent=False)
            # The web tier too: jobs on the GPU hosts log to MLflow through its tracking proxy.
            forwarder = Forwarder(BRIDGE_IP, (*FORWARDED_PORTS, stack.port))
            stack.env["HANGAR_TRACKING_PROXY_URL"] = f"http://{BRIDGE_IP}:{stack.port}/api/mlflow"
            stack.start(timeout=120)
            fleet = Fleet(stack, hosts, shared)
            for host in HOSTS:
                fleet.start(host)
            yield fleet
            for host in list(fleet.agents):
                fleet.stop(host)
            stack.stop()
            stack = None
            admin.execute(f'DROP DATABASE IF EXISTS "{mlflow_db}" WITH (FORCE)')
    finally:
        if stack is not None:
            stack.stop()
        if forwarder is not None:
            forwarder.stop()
        hosts.close()


GLOO_ALL_REDUCE = """
import socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank={dist.get_rank()} host={socket.gethostname()} sum={value.item():g}", flush=True)
dist.barrier()  # TRAPS.md: gloo can abort at exit without it
dist.destroy_process_group()
"""


def test_each_agent_advertises_its_own_address_and_interface(fleet):
    for host, address in HOSTS.items():
        node = fleet.node(host)
        assert (node["hostname"], node["address"], node["network_interface"]) == (host, address, "eth0")
        assert f"advertises {address} (ranks' traffic on eth0): the interface that reaches the database" in fleet.log(
            host
        )


def test_a_two_node_gloo_job_meets_at_rank_zeros_address_with_no_host_names_resolving(fleet):
    pytest.importorskip("torch")
    job = fleet.stack.submit([sys.executable, "-c", GLOO_ALL_REDUCE], nodes=2, gpus_per_node=1)
    done = fleet.stack.wait_for(job["id"], ("succeeded", "failed", "cancelled"), timeout=180)
    attempt = done["attempts"][-1]
    assert done["state"] == "succeeded", (attempt["reason"], [line["text"] for line in fleet.lines(job["id"])])
    texts = sorted(line["text"] for line in fleet.lines(job["id"]) if "sum=" in line["text"])
    assert texts == ["rank=0 host=gpu-a sum=3", "rank=1 host=gpu-b sum=3"] or texts == [
        "rank=0 host=gpu-b sum=3",
        "rank=1 host=gpu-a sum=3",
    ]
    print(f"\nmultihost: 2-node gloo job preflight (checks + rendezvous) {attempt['preflight_seconds']:.2f} s")


def test_secrets_and_mlflow_work_on_the_second_host_and_an_agent_without_the_shared_settings_refuses(fleet):
    refused = subprocess.run(
        ["ip", "netns", "exec", fleet.hosts.ns("gpu-b"), sys.executable, "manage.py", "agent", "--node", "gpu-c"],
        cwd=BASE_DIR,
        env=fleet.agent_env("gpu-c", shared=False),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode != 0
    assert "HANGAR_SECRET_KEY: the database is on another host" in refused.stderr
    assert "MLFLOW_TRACKING_URI" in refused.stderr

    fleet.stop("gpu-a")  # only the second host can take them
    try:
        script = (
            "import os, mlflow\n"
            "assert os.environ['API_TOKEN'] == 'tok-123456'\n"
            "mlflow.log_metric('val_loss', 0.25)\n"
            "print('logged from', os.uname().nodename, flush=True)\n"
        )
        job = fleet.stack.submit([sys.executable, "-c", script], secret_env={"API_TOKEN": "tok-123456"})
        done = fleet.stack.wait_for(job["id"], ("succeeded", "failed"), timeout=120)
        texts = [line["text"] for line in fleet.lines(job["id"])]
        assert done["state"] == "succeeded", (done["attempts"][-1]["reason"], "\n".join(texts))
        assert done["attempts"][-1]["node"] == "gpu-b"
        assert any(line["text"] == "logged from gpu-b" for line in fleet.lines(job["id"]))
        runs = fleet.stack.api("GET", f"/api/v1/jobs/{job['id']}/").json()
        assert runs["mlflow_run_id"], runs
        metrics = fleet.stack.api("GET", f"/api/v1/jobs/{job['id']}/metrics/").json()
        assert "val_loss" in str(metrics), metrics  # the portal reads the run the second host logged
    finally:
        fleet.start("gpu-a")


TICKS = """
import os, time
rank = os.environ["RANK"]
attempt = os.environ["HANGAR_ATTEMPT"]
# The first attempt outlasts the partition; its rerun is short.
for i in range(150 if attempt == "1" else 5):
    print(f"attempt {attempt} rank {rank} tick {i}", flush=True)
    time.sleep(0.5)
"""


def test_a_partitioned_host_loses_its_attempt_which_reruns_and_every_line_it_printed_is_stored_once(fleet):
    job = fleet.stack.submit([sys.executable, "-c", TICKS], nodes=2, gpus_per_node=1)
    running = fleet.stack.wait_for(job["id"], ("running",), timeout=120)
    first = running["attempts"][-1]
    cut = next(r["node"] for r in first["placement"] if r["rank"] == 1)
    time.sleep(3)  # both ranks print
    fleet.hosts.partition(cut, True)
    cut_at = time.monotonic()
    try:
        time.sleep(45)
    finally:
        fleet.hosts.partition(cut, False)
    healed_at = time.monotonic()
    done = fleet.stack.wait_for(job["id"], ("succeeded", "failed"), timeout=240)
    assert done["state"] == "succeeded", done["attempts"]
    attempts = {a["number"]: a for a in done["attempts"]}
    assert first["number"] == 1 and attempts[1]["state"] == "lost" and len(attempts) >= 2

    def ticks(number: int, rank: int) -> list[int]:
        prefix = f"attempt {number} rank {rank} tick "
        return [
            int(t[len(prefix) :]) for t in (line["text"] for line in fleet.lines(job["id"])) if t.startswith(prefix)
        ]

    # Wait for the cut-off rank's spool to reach the database once the link is back.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        late = [
            t["text"] for t in fleet.lines(job["id"]) if t["text"].startswith("[hangar] rank 1") and "late" in t["text"]
        ]
        if late:
            break
        time.sleep(1)
    stored = ticks(first["number"], 1)
    assert stored == list(range(len(stored))), "a line of the partitioned rank is missing or stored twice"
    assert len(stored) > 2 * 10, stored[-5:]  # it went on printing while cut off (0.5 s a line)
    assert late, "no [hangar] line says the rank's lines came late"
    assert ticks(max(attempts), 0) == list(range(5))  # the rerun ran whole
    print(
        f"\nmultihost: partition {healed_at - cut_at:.0f} s; rank 1 of attempt {first['number']} stored "
        f"{len(stored)} lines once each; {late[0]}"
    )


def test_rank_zero_unreachable_makes_its_node_the_suspect_then_cordoned_and_the_queue_says_why(fleet):
    # gpu-a advertises an address no host has: rank 1 cannot reach rank 0 there.
    fleet.start("gpu-a", HANGAR_NODE_ADDRESS=f"{SUBNET}.77", HANGAR_NODE_NETWORK_INTERFACE="eth0")
    try:
        job = fleet.stack.submit([sys.executable, "-c", "print('never')"], nodes=2, gpus_per_node=1)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if fleet.node("gpu-a")["state"] == "cordoned":
                break
            time.sleep(0.5)
        # The failing rank cordons gpu-a in its preflight, then ends its attempt: the job is requeued after.
        current = fleet.stack.wait_for(job["id"], ("queued",), timeout=60)
        failed = [a for a in current["attempts"] if a["state"] == "failed"]
        # Cordoned once two attempts pointed at gpu-a (an earlier test's may have been one of them).
        assert failed, current["attempts"]
        assert "rendezvous failed for" in fleet.node("gpu-a")["state_reason"]
        for attempt in failed:
            assert attempt["placement"][0]["node"] == "gpu-a"  # rank 0 on gpu-a each time
            assert "suspect: node gpu-a" in attempt["reason"], attempt["reason"]
            assert attempt["failure_class"] == "infra"
        assert fleet.node("gpu-a")["state"] == "cordoned"
        assert fleet.node("gpu-b")["state"] == "ready"  # the reporting rank's node stays in service
        queue = fleet.stack.api("GET", "/api/v1/queue/").json()
        row = next(r for r in queue["waiting"] if r["id"] == job["id"])
        assert row["reason"]["code"] == "no_ready_node" and "gpu-a cordoned" in row["reason"]["message"], row
        fleet.stack.api("POST", f"/api/v1/jobs/{job['id']}/cancel/")
    finally:
        fleet.stop("gpu-a")
