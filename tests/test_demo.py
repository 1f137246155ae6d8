"""`manage.py demo`: soon after it starts, its fleet shows running, queued, finished, failed and
cordoned examples (and the cordon's notification was delivered).

Alone on this 2-core VM that takes 68–82 s. The suite runs it beside other live stacks, where on a
slow day of the VM it took longer than 90 s twice (the code before this bound did too), so the test
allows 180 s and prints what it took: it checks that the demo works; how fast is for a quiet machine."""

import contextlib
import secrets
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.livestack import BASE_DIR, die_with_parent, free_port, stack_env

pytestmark = pytest.mark.e2e

WANTED = ("running", "queued", "succeeded", "failed", "cordoned", "delivered")


@dataclass
class Demo:
    url: str
    data: Path
    password: str
    proc: subprocess.Popen

    @property
    def db(self) -> Path:
        return self.data / "hangar.sqlite3"

    def output(self) -> str:
        return (self.data / "demo.log").read_text()[-3000:]

    def examples(self) -> dict[str, int]:
        if not self.db.exists():
            return {}
        try:
            with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5) as conn:
                jobs = dict(conn.execute("SELECT state, COUNT(*) FROM jobs_job GROUP BY state").fetchall())
                cordoned = conn.execute("SELECT COUNT(*) FROM fleet_node WHERE state = 'cordoned'").fetchone()[0]
                nodes = conn.execute("SELECT COUNT(DISTINCT gpu_model), COUNT(*) FROM fleet_node").fetchone()
                told = conn.execute("SELECT COUNT(*) FROM jobs_delivery WHERE state = 'delivered'").fetchone()[0]
        except sqlite3.OperationalError:  # not migrated yet, or busy
            return {}
        return {**jobs, "cordoned": cordoned, "gpu_types": nodes[0], "nodes": nodes[1], "delivered": told}

    def query(self, sql: str) -> list[tuple]:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=5) as conn:
            return conn.execute(sql).fetchall()

    def wait_for_examples(self, timeout: float = 90) -> dict[str, int]:
        seen: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(seen.get(k) for k in WANTED):
            assert self.proc.poll() is None, self.output()
            time.sleep(2)
            seen = self.examples() or seen
        assert all(seen.get(k) for k in WANTED), (seen, self.output())
        return seen


@contextlib.contextmanager
def running_demo():
    data = Path(tempfile.mkdtemp(prefix="hangar-demo-"))
    port, password = free_port(), secrets.token_urlsafe(12)
    env = {**stack_env(), "HANGAR_DATA_DIR": str(data), "HANGAR_PORT": str(port), "HANGAR_ADMIN_PASSWORD": password}
    with (data / "demo.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "demo"],
            cwd=BASE_DIR,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        demo = Demo(f"http://127.0.0.1:{port}", data, password, proc)
        try:
            yield demo
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_the_demo_has_a_living_fleet_soon_after_it_starts():
    with running_demo() as demo:
        started = time.monotonic()
        seen = demo.wait_for_examples(180)
        print(f"demo: every example within {time.monotonic() - started:.0f} s")
        assert seen["nodes"] == 8 and seen["gpu_types"] == 2
        token = (demo.data / "metrics_token").read_text().strip()  # printed once at first start
        scrape = httpx.get(f"{demo.url}/metrics", timeout=10, headers={"Authorization": f"Bearer {token}"})
        assert scrape.status_code == 200
    assert demo.proc.returncode == 0, demo.output()
