"""`manage.py demo`: within 90 s its fleet shows running, queued, finished, failed and cordoned examples."""

import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.livestack import BASE_DIR, die_with_parent, free_port

pytestmark = pytest.mark.e2e


def examples(db: Path) -> dict[str, int]:
    if not db.exists():
        return {}
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        try:
            jobs = dict(conn.execute("SELECT state, COUNT(*) FROM jobs_job GROUP BY state").fetchall())
            cordoned = conn.execute("SELECT COUNT(*) FROM fleet_node WHERE state = 'cordoned'").fetchone()[0]
            nodes = conn.execute("SELECT COUNT(DISTINCT gpu_model), COUNT(*) FROM fleet_node").fetchone()
        except sqlite3.OperationalError:  # not migrated yet, or busy
            return {}
    return {**jobs, "cordoned": cordoned, "gpu_types": nodes[0], "nodes": nodes[1]}


def test_the_demo_has_a_living_fleet_within_90_seconds():
    data = Path(tempfile.mkdtemp(prefix="hangar-demo-"))
    port = free_port()
    env = {**os.environ, "HANGAR_DATA_DIR": str(data), "HANGAR_PORT": str(port)}
    log = (data / "demo.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "demo"],
        cwd=BASE_DIR,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,
    )
    wanted = ("running", "queued", "succeeded", "failed", "cordoned")
    seen: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all(seen.get(k) for k in wanted):
            assert proc.poll() is None, (data / "demo.log").read_text()[-3000:]
            time.sleep(2)
            seen = examples(data / "hangar.sqlite3") or seen
        assert all(seen.get(k) for k in wanted), (seen, (data / "demo.log").read_text()[-3000:])
        assert seen["nodes"] == 8 and seen["gpu_types"] == 2
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, (data / "demo.log").read_text()[-3000:]
