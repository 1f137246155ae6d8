"""The whole path, end to end, in both modes: a real `manage.py up` (web server,
scheduler and a Celery worker as the node agent), a real job process, a real
websocket client.

Services mode needs PostgreSQL and Redis; under CI (CI=true) their absence is a
failure, elsewhere the services tests are skipped with the reason.
"""

import json
import os
import sys
import textwrap
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.factories import services_database
from tests.livestack import LiveStack
from tests.processes import alive, processes_of

pytestmark = pytest.mark.e2e

PY = sys.executable


@pytest.fixture(scope="module", params=["embedded", "services"])
def stack(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(f"stack-{request.param}")
    if request.param == "embedded":
        with LiveStack(data_dir=str(data_dir)) as live:
            yield live
        return
    services = services_database()
    with services as env, LiveStack(env=env, data_dir=str(data_dir)) as live:
        yield live


def follow_logs(
    stack: LiveStack, job_id: int, after: dict | None = None, stop_after: int | None = None, timeout=60, filters=""
):
    """Read the log websocket until the job's final state (or `stop_after` lines)."""
    after = after or {"attempt": 0, "seq": 0}
    url = f"{stack.ws_url}/ws/jobs/{job_id}/logs/?after_attempt={after['attempt']}&after_seq={after['seq']}{filters}"
    lines, final = [], None
    with connect(url, additional_headers=stack.headers(), open_timeout=10) as ws:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message["type"] == "lines":
                lines.extend(message["lines"])
                if stop_after is not None and len(lines) >= stop_after:
                    return lines, None
            elif message["type"] == "state" and message["final"]:
                final = message
                break
    return lines, final


def script(body: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(body)]


def test_lines_arrive_in_order_over_websocket_and_failure_is_recorded(stack):
    job = stack.submit(
        script(
            """
            import sys, time
            for i in range(30):
                print(f"out {i}", flush=True)
                print(f"err {i}", file=sys.stderr, flush=True)
                time.sleep(0.01)
            sys.exit(3)
            """
        ),
        name="printer",
    )
    lines, final = follow_logs(stack, job["id"])

    out = [line["text"] for line in lines if line["stream"] == "stdout"]
    err = [line["text"] for line in lines if line["stream"] == "stderr"]
    assert out == [f"out {i}" for i in range(30)]
    assert err == [f"err {i}" for i in range(30)]
    assert all(line["severity"] == "WARNING" for line in lines if line["stream"] == "stderr")
    seqs = [line["seq"] for line in lines]
    assert seqs == list(range(1, len(seqs) + 1))
    assert final["state"] == "failed" and final["exit_code"] == 3

    done = stack.job(job["id"])
    assert (done["state"], done["exit_code"], done["failure_class"]) == ("failed", 3, "user")
    (attempt,) = done["attempts"]
    stamps = [attempt[k] for k in ("queued_at", "scheduled_at", "started_at", "running_at", "finished_at")]
    assert all(stamps), attempt
    assert stamps == sorted(stamps)
    assert attempt["exit_code"] == 3 and attempt["node"] == "node-a"


def test_reconnecting_client_resumes_without_loss_or_duplicates(stack):
    job = stack.submit(
        script(
            """
            import time
            for i in range(300):
                print(f"line {i}", flush=True)
                if i % 50 == 0:
                    time.sleep(0.2)
            """
        )
    )
    seen = []
    cursor = {"attempt": 0, "seq": 0}
    final = None
    while final is None:
        # Drop the connection every 40 lines and come back from the last cursor.
        batch, final = follow_logs(stack, job["id"], after=cursor, stop_after=40)
        seen.extend(batch)
        if batch:
            cursor = {"attempt": batch[-1]["attempt"], "seq": batch[-1]["seq"]}
    texts = [line["text"] for line in seen if line["stream"] == "stdout"]
    assert texts == [f"line {i}" for i in range(300)]
    assert [line["seq"] for line in seen] == list(range(1, len(seen) + 1))
    assert final["state"] == "succeeded"


def test_cancel_stops_the_whole_process_group(stack):
    job = stack.submit(
        script(
            """
            import os, subprocess, time
            child = subprocess.Popen(["sleep", "300"])
            print("ids", os.getuid(), os.getpid(), child.pid, flush=True)
            time.sleep(300)
            """
        )
    )
    stack.wait_for(job["id"], ("running",))
    said = wait_for_line(stack, job["id"], "ids ")
    uid, parent, child = map(int, said.split()[1:])
    # In a sandbox its pids are its PID namespace's: the host's are those of its own uid.
    pids = [p for p in processes_of(uid) if alive(p)] if uid != os.getuid() else [parent, child]
    assert len(pids) >= 2 and all(alive(p) for p in pids), pids

    response = stack.api("POST", f"/api/v1/jobs/{job['id']}/cancel/", json={"reason": "test cancel"})
    assert response.status_code == 200
    done = stack.wait_for(job["id"], ("cancelled", "failed", "succeeded"), timeout=30)

    assert done["state"] == "cancelled"
    assert done["attempts"][-1]["failure_class"] == "cancelled"
    wait_until_gone(pids, timeout=10)


def wait_for_line(stack: LiveStack, job_id: int, prefix: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = stack.api("GET", f"/api/v1/jobs/{job_id}/logs/").json()["lines"]
        if said := next((line["text"] for line in lines if line["text"].startswith(prefix)), None):
            return said
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} printed no {prefix!r} line in {timeout}s")


def test_unauthenticated_websocket_is_refused(stack):
    """Through the real server the client sees the close code (accepted, then closed), not an HTTP 403."""
    job = stack.submit([PY, "-c", "print('x')"])
    with pytest.raises(ConnectionClosed) as refused:
        with connect(f"{stack.ws_url}/ws/jobs/{job['id']}/logs/", open_timeout=10) as ws:
            ws.recv(timeout=10)
    assert refused.value.rcvd.code == 4401


def wait_until_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), f"still alive: {[p for p in pids if alive(p)]}"


def test_sixty_short_jobs_each_run_once_and_no_gpu_is_ever_held_twice(stack):
    """Short jobs back to back on the stack's one 4-GPU agent: every job ends after exactly one
    attempt, and the attempts' own timings show no GPU taken by an attempt before the one holding
    it had ended. The hand-off gaps are bounded loosely (speed is bench/throughput.py's)."""
    from datetime import datetime

    ids = [stack.submit(["echo", f"short {i}"], name=f"short-{i}")["id"] for i in range(60)]
    jobs = [stack.wait_for(job_id, ("succeeded", "failed", "cancelled"), timeout=300) for job_id in ids]

    assert [job["state"] for job in jobs] == ["succeeded"] * 60
    assert [len(job["attempts"]) for job in jobs] == [1] * 60
    by_gpu: dict[tuple[str, int], list[dict]] = {}
    for job in jobs:
        attempt = job["attempts"][0]
        times = {key: datetime.fromisoformat(attempt[key]) for key in ("started_at", "running_at", "finished_at")}
        for rank in attempt["placement"]:
            for gpu in rank["gpus"]:
                by_gpu.setdefault((rank["node"], gpu), []).append(times)
    assert sum(len(held) for held in by_gpu.values()) == 60  # one GPU each
    gaps = []
    for held in by_gpu.values():
        held.sort(key=lambda times: times["started_at"])
        for before, after in zip(held, held[1:], strict=False):
            assert after["started_at"] >= before["finished_at"], (before, after)
            gaps.append((after["running_at"] - before["finished_at"]).total_seconds())
    assert gaps and max(gaps) < 60, sorted(gaps)[-5:]
