"""A whole Hangar (web, scheduler, node agent) started with `manage.py up` in a
throw-away data directory: what the end-to-end tests and the benches drive.

It talks to the stack only as a user would: HTTP, websockets and the API token
that `manage.py create_token` prints.
"""

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

BASE_DIR = Path(__file__).resolve().parent.parent
POSTGRES_ADMIN_URL = os.environ.get("HANGAR_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_TEST_URL = os.environ.get("HANGAR_TEST_REDIS_URL", "redis://127.0.0.1:6379/5")


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the test or bench process that started it dies,
    so a killed run leaves no stack behind (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


# Isolation off: for benches that measure the control plane without the sandbox's own cost
# (bench/start_latency.py --sandbox compares both); stacks are sandboxed by default, as users' are.
UNSANDBOXED = {"HANGAR_SANDBOX": "off", "HANGAR_JOB_UID_RANGE": "off"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stack_env() -> dict[str, str]:
    """This process's environment for a stack of its own, less its metrics folder: settings export
    it for their own children, and a stack's `up` empties its folder at start (under parallel
    workers, the test worker's, with the measurements its tests then scrape for)."""
    return {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}


class LiveStack:
    def __init__(
        self,
        env: dict[str, str] | None = None,
        data_dir: str | None = None,
        local_agent: bool = True,
        scheduler: bool = True,
        checkout: Path | None = None,
    ):
        # `checkout`: another copy of Hangar (a clone with its own .venv), started as the README
        # says (`make start`); by default this one, with this interpreter.
        self.base_dir = Path(checkout or BASE_DIR)
        self.python = str(self.base_dir / ".venv" / "bin" / "python") if checkout else sys.executable
        self.via_make = checkout is not None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="hangar-stack-"))
        self.port = free_port()
        self.password = secrets.token_urlsafe(12)
        self.clients: dict[int, httpx.Client] = {}  # api(): one kept-alive HTTP client per thread
        self.env = {
            **stack_env(),
            "HANGAR_DATA_DIR": str(self.data_dir),
            "HANGAR_PORT": str(self.port),
            "HANGAR_ADMIN_PASSWORD": self.password,
            "HANGAR_NODE_NAME": "node-a",
            "HANGAR_SIMULATE_GPUS": "1",
            "HANGAR_HEARTBEAT_SECONDS": "1",
            "HANGAR_KILL_GRACE_SECONDS": "2",
            # Its own rendezvous ports (MASTER_PORT = base + attempt id % 1000): stacks of parallel
            # test workers number their attempts alike, and would meet on the same ports.
            "HANGAR_MASTER_PORT_BASE": str(random.randrange(4000, 17000)),
            # Sandboxed as users' are, but not in the unit tests' uid range: a unit test's job N
            # runs as 200000 + N, and a stack's job N, beside it on this machine, would take it.
            "HANGAR_JOB_UID_RANGE": "300000-399999",
            **(env or {}),
        }
        self.local_agent = local_agent
        # False: `up --no-scheduler`; the caller runs schedulers with start_scheduler().
        self.scheduler = scheduler
        self.proc: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}
        self.token = ""
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "stack.log"

    def manage(self, *args: str) -> str:
        done = subprocess.run(
            [self.python, "manage.py", *args],
            cwd=self.base_dir,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip()

    def start(self, timeout: float = 150) -> "LiveStack":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        for _ in range(3):
            self._launch()
            try:
                # The banner, not an open port: on a shared machine another
                # process may hold the port this stack was given.
                self._wait(self._banner_shown, deadline, "the web server to listen")
                break
            except RuntimeError:
                if self.proc.poll() is None or "is in use" not in self.output():
                    raise
                self._use_port(free_port())  # taken between free_port() and bind: try another
        self.token = self.manage("create_token", "admin", "--name", "livestack")
        if self.local_agent:
            self._wait(self._node_ready, deadline, "a node agent to register")
        return self

    def _launch(self) -> None:
        with open(self.log_path, "ab") as out:
            options = [*([] if self.local_agent else ["--no-agent"]), *([] if self.scheduler else ["--no-scheduler"])]
            argv = ["make", "start"] if self.via_make else [self.python, "manage.py", "up", *options]
            self.proc = subprocess.Popen(
                argv,
                cwd=self.base_dir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def _use_port(self, port: int) -> None:
        self.port = port
        self.env["HANGAR_PORT"] = str(port)
        self.url = f"http://127.0.0.1:{port}"
        self.ws_url = f"ws://127.0.0.1:{port}"

    def _banner_shown(self) -> bool:
        return f"running at http://127.0.0.1:{self.port}/" in self.output() and self._port_open()

    def _wait(self, ready, deadline: float, what: str) -> None:
        """Until `ready()` or the deadline; asked at least once, also when an earlier step of a
        start on a loaded machine used up the deadline (the node was ready, never asked)."""
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`manage.py up` exited with {self.proc.returncode}:\n{self.output()}")
            if ready():
                return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"timed out waiting for {what}:\n{self.output()}")
            time.sleep(0.2)

    def _port_open(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def _node_ready(self, name: str | None = None) -> bool:
        nodes = self.api("GET", "/api/v1/nodes/").json()["results"]
        return any(n["state"] == "ready" and name in (None, n["name"]) for n in nodes)

    def start_agent(self, name: str, gpus: int = 4, model: str = "H100", timeout: float = 60) -> subprocess.Popen:
        """One more node agent (simulated GPUs) on the same database and broker."""
        env = {**self.env, "HANGAR_NODE_NAME": name, "HANGAR_SIM_GPUS": str(gpus), "HANGAR_SIM_GPU_MODEL": model}
        with open(self.data_dir / f"agent-{name}.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "manage.py", "agent"],
                cwd=BASE_DIR,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.agents[name] = proc
        deadline = time.monotonic() + timeout
        while not self._node_ready(name):
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (self.data_dir / f"agent-{name}.log").read_text(errors="replace")
                raise RuntimeError(f"agent {name} did not register (exit {proc.poll()}):\n{log[-5000:]}")
            time.sleep(0.2)
        return proc

    def start_scheduler(self, name: str = "scheduler", env: dict[str, str] | None = None) -> subprocess.Popen:
        """A scheduler process of this stack's own (with `scheduler=False`), logging to `<name>.log`."""
        with open(self.data_dir / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "manage.py", "scheduler"],
                cwd=BASE_DIR,
                env={**self.env, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.agents[name] = proc  # stopped with the agents
        return proc

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        for client in list(self.clients.values()):
            client.close()
        self.clients.clear()
        for proc in [*self.agents.values(), self.proc]:
            if proc is not None and proc.poll() is None and proc is self.proc and self.via_make:
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at make's terminal: its whole group
            elif proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT if proc is self.proc else signal.SIGTERM)
        for proc in [*self.agents.values(), self.proc]:
            if proc is None:
                continue
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> "LiveStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- talking to it -------------------------------------------------
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def api(self, method: str, path: str, **kwargs) -> httpx.Response:
        """A request on this thread's kept-alive client: a client made per request (httpx.request)
        loads its TLS trust store each time, ~30 ms of CPU that latency figures would count."""
        client = self.clients.get(threading.get_ident())
        if client is None:
            client = self.clients[threading.get_ident()] = httpx.Client(timeout=30)
        return client.request(method, self.url + path, headers=self.headers(), **kwargs)

    def submit(self, command: list[str], **fields) -> dict:
        response = self.api("POST", "/api/v1/jobs/", json={"project": "default", "command": command, **fields})
        response.raise_for_status()
        return response.json()

    def job(self, job_id: int) -> dict:
        return self.api("GET", f"/api/v1/jobs/{job_id}/").json()

    def wait_for(self, job_id: int, states: tuple[str, ...], timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["state"] in states:
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} is {job['state']}, not in {states}, after {timeout}s\n{self.output()}")


class ServicesDatabase:
    """A fresh PostgreSQL database and a Redis key prefix of its own for one services-mode stack,
    on the test servers (HANGAR_TEST_POSTGRES_URL, HANGAR_TEST_REDIS_URL) or the ones given."""

    def __init__(self, postgres_url: str = POSTGRES_ADMIN_URL, redis_url: str = REDIS_TEST_URL):
        self.name = f"hangar_test_{uuid.uuid4().hex[:10]}"
        self.postgres_url, self.redis_url = postgres_url, redis_url

    def available(self) -> str | None:
        """None when PostgreSQL and Redis answer, else what is missing."""
        import psycopg
        import redis

        try:
            psycopg.connect(self.postgres_url, connect_timeout=3).close()
        except psycopg.Error as exc:
            return f"PostgreSQL at {self.postgres_url} is unreachable: {exc}"
        try:
            redis.Redis.from_url(self.redis_url, socket_timeout=3).ping()
        except redis.RedisError as exc:
            return f"Redis at {self.redis_url} is unreachable: {exc}"
        return None

    def __enter__(self) -> dict[str, str]:
        import psycopg

        with psycopg.connect(self.postgres_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')
        database_url = self.postgres_url.rsplit("/", 1)[0] + "/" + self.name
        return {
            "DATABASE_URL": database_url,
            "CELERY_BROKER_URL": self.redis_url,
            "REDIS_URL": self.redis_url,
            "HANGAR_REDIS_PREFIX": self.name,
        }

    def __exit__(self, *exc) -> None:
        import psycopg
        import redis

        client = redis.Redis.from_url(self.redis_url)
        for key in client.scan_iter(f"{self.name}*"):
            client.delete(key)

        with psycopg.connect(self.postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
