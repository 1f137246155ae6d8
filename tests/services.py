"""Private PostgreSQL and Redis servers that a drill may stop and start again.

The shared servers on 5432/6379 serve every test run on the machine, so a drill
that restarts a service starts its own on a free port and tears it down after.
"""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.livestack import die_with_parent, free_port

PG_BIN = Path("/usr/lib/postgresql/15/bin")


def wait_for_port(port: int, timeout: float = 30, up: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                if up:
                    return
        except OSError:
            if not up:
                return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} did not {'open' if up else 'close'} within {timeout}s")


class PrivateRedis:
    """A throw-away redis-server (no persistence: a restart loses every key, the worst case)."""

    def __init__(self):
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def missing() -> str | None:
        return None if shutil.which("redis-server") else "redis-server is not installed"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "PrivateRedis":
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [*argv, "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None
        wait_for_port(self.port, up=False)

    def __enter__(self) -> "PrivateRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class PrivatePostgres:
    """A throw-away PostgreSQL 15 cluster (initdb as the postgres user: it refuses root)."""

    def __init__(self):
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="hangar-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "socket"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def missing() -> str | None:
        if not (PG_BIN / "initdb").exists():
            return f"PostgreSQL binaries not found in {PG_BIN}"
        if os.geteuid() != 0:
            return "starting a private PostgreSQL needs root (initdb runs as the postgres user via runuser)"
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "no postgres user to run initdb as"
        return None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def as_postgres(self, *argv: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", *argv], check=True, capture_output=True, preexec_fn=die_with_parent
        )

    def init(self) -> "PrivatePostgres":
        self.socket_dir.mkdir(parents=True)
        shutil.chown(self.root, "postgres")
        shutil.chown(self.socket_dir, "postgres")
        self.as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        return self

    def start(self) -> None:
        # The postmaster runs in the foreground as this process's child, so a killed test
        # run takes it down too (SIGTERM on the parent's death); pg_ctl would detach it.
        argv = [str(PG_BIN / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.socket_dir)]
        options = ["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=300"]
        with open(self.root / "postgres.log", "ab") as log:
            self.proc = subprocess.Popen(
                [*argv, *options], user="postgres", stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
            )
        self.wait_ready()

    def wait_ready(self, timeout: float = 30) -> None:
        """Until it accepts a session (it listens before it has finished starting up)."""
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL on port {self.port} did not start; see {self.root}/postgres.log")
                time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown (SIGINT): clients are disconnected, as in a database restart."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=30)
        self.proc = None
        wait_for_port(self.port, up=False)

    def __enter__(self) -> "PrivatePostgres":
        self.init().start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
