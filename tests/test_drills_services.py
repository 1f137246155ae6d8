"""Reliability drills in services mode (issue 8, drills 2, 3, 7 and 8): real stacks
on PostgreSQL and Redis, with the broker or the database restarted under load,
a log flood read by a reconnecting viewer, and a burst of concurrent submits.

Each drill prints one line `drill N: key=value ...` with its figures and asserts
the guarantee: no job lost, none run twice, no 5xx but a 503 in the API's error
shape while the database is down. Restarts use private servers on free ports
(tests/services.py), never the shared ones.
"""

import json
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import psycopg
import pytest
from websockets.sync.client import connect

from tests.livestack import LiveStack
from tests.services import PrivatePostgres, PrivateRedis

pytestmark = pytest.mark.e2e

PY = sys.executable
FINAL = ("succeeded", "failed", "cancelled")
# Short timings so the drills fit in minutes: a lost wake-up or an unstarted attempt
# is noticed within seconds, not the production defaults' minutes.
FAST = {
    "HANGAR_SCHEDULER_INTERVAL": "0.5",
    "HANGAR_HEARTBEAT_SECONDS": "1",
    "HANGAR_START_TIMEOUT_SECONDS": "8",
    "HANGAR_LEASE_SECONDS": "30",
    "HANGAR_MLFLOW": "0",
    "HANGAR_SIM_GPUS": "5",
    "HANGAR_API_RATE_LIMIT": "100000/min",
    "HANGAR_DB_POOL_TIMEOUT": "3",
}


def need(missing: str | None) -> None:
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"the services drills must run in CI: {missing}")
        pytest.skip(missing)


@contextmanager
def services_stack(tmp_path, **env: str):
    """A stack on a private Redis (broker and Channels layer) and a private PostgreSQL:
    the drills restart them, and a burst of a thousand requests must not take the
    shared server's connections from other test runs. Yields (stack, redis, postgres)."""
    need(PrivateRedis.missing() or PrivatePostgres.missing())
    with PrivateRedis() as redis, PrivatePostgres() as postgres:
        services = {
            "DATABASE_URL": postgres.url,
            "CELERY_BROKER_URL": redis.url,
            "REDIS_URL": redis.url,
            "HANGAR_REDIS_PREFIX": "drill",
        }
        with LiveStack(env={**services, **FAST, **env}, data_dir=str(tmp_path / "stack")) as stack:
            yield stack, redis, postgres


def sql(stack: LiveStack, query: str, *params) -> list[tuple]:
    with psycopg.connect(stack.env["DATABASE_URL"], autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def job_states(stack: LiveStack) -> Counter:
    return Counter(dict(sql(stack, "SELECT state, count(*) FROM jobs_job GROUP BY state")))


def wait_until(check, timeout: float, what: str, stack: LiveStack, step: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{stack.output()[-6000:]}")


def report(number: int, **figures) -> None:
    text = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    print(f"\ndrill {number}: {text}")


# --- drill 2: the broker restarts under load ------------------------------------------


def test_drill_2_redis_restart_loses_and_repeats_no_job(tmp_path):
    with services_stack(tmp_path) as (stack, redis, _):
        marker = "drill2-ran-job"
        command = ["sh", "-c", f"echo {marker}-$HANGAR_JOB_ID; sleep 2"]
        ids = [stack.submit(command, name=f"d2-{i}")["id"] for i in range(55)]
        wait_until(lambda: job_states(stack)["running"] >= 5, 60, "5 running jobs", stack)
        queued_at_restart = job_states(stack)["queued"]
        down = time.monotonic()
        redis.stop()
        time.sleep(3)
        redis.start()
        outage = time.monotonic() - down
        restarted = sql(stack, "SELECT now()")[0][0]
        wait_until(lambda: job_states(stack)["succeeded"] == 55, 180, "all 55 jobs to succeed", stack)
        total = time.monotonic() - down

        assert stack.proc.poll() is None, "a Hangar process died (manage.py up exits when a child does)"
        assert job_states(stack) == Counter({"succeeded": 55})
        ran = dict(
            sql(stack, "SELECT job_id, count(*) FROM jobs_logline WHERE text LIKE %s GROUP BY job_id", marker + "-%")
        )
        assert ran == {job_id: 1 for job_id in ids}, "every job's command ran exactly once"
        started = Counter(j for (j,) in sql(stack, "SELECT job_id FROM jobs_attempt WHERE running_at IS NOT NULL"))
        assert set(started.values()) == {1}
        attempts = sql(stack, "SELECT count(*), count(*) FILTER (WHERE state = 'lost') FROM jobs_attempt")[0]
        first = sql(stack, "SELECT min(started_at) FROM jobs_attempt WHERE started_at > %s", restarted)[0][0]
        report(
            2,
            jobs=55,
            queued_at_restart=queued_at_restart,
            outage_s=outage,
            first_start_after_restart_s=(first - restarted).total_seconds(),
            all_done_s=total,
            attempts=attempts[0],
            lost_unstarted_attempts=attempts[1],
            commands_run_twice=0,
        )


# --- drill 3: the database restarts under load ----------------------------------------


def logged_in(stack: LiveStack) -> httpx.Client:
    """A browser-like session (pages need one; the API uses the token)."""
    client = httpx.Client(base_url=stack.url, timeout=30)
    client.get("/login/")
    form = {"username": "admin", "password": stack.password, "csrfmiddlewaretoken": client.cookies["csrftoken"]}
    assert client.post("/login/", data=form, headers={"Referer": stack.url + "/login/"}).status_code == 302
    return client


def probe_during_outage(
    stack: LiveStack, browser: httpx.Client, seconds: float
) -> list[tuple[str, httpx.Response, float]]:
    """Ask the API and a page, alternately, for `seconds`: what a user sees meanwhile."""
    seen, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        for kind, call in (("api", lambda: stack.api("GET", "/api/v1/jobs/")), ("page", lambda: browser.get("/"))):
            began = time.monotonic()
            seen.append((kind, call(), time.monotonic() - began))
    return seen


def test_drill_3_database_restart_answers_503_and_loses_no_transition(tmp_path):
    with services_stack(tmp_path) as (stack, _, pg):
        browser = logged_in(stack)
        command = ["sh", "-c", "echo drill3-start; sleep 16; echo drill3-done"]
        job = stack.submit(command, name="across-the-outage")
        short = stack.submit(["sh", "-c", "echo drill3-short; sleep 4; echo drill3-short-done"], name="ends-in-outage")
        stack.wait_for(job["id"], ("running",), timeout=30)
        stack.wait_for(short["id"], ("running",), timeout=30)
        time.sleep(1)
        down = time.monotonic()
        pg.stop()
        seen = probe_during_outage(stack, browser, 10)
        pg.start()
        outage = time.monotonic() - down
        first_ok = wait_until(
            lambda: stack.api("GET", "/api/v1/jobs/").status_code == 200 and time.monotonic(),
            30,
            "the API to answer again",
            stack,
        )
        done = stack.wait_for(job["id"], FINAL, timeout=60)
        ended_in_outage = stack.wait_for(short["id"], FINAL, timeout=60)
        after = stack.submit(["echo", "after the outage"], name="after-the-outage")
        after = stack.wait_for(after["id"], FINAL, timeout=60)

        statuses = Counter(response.status_code for _, response, _ in seen)
        assert set(statuses) <= {200, 503} and statuses[503] > 0, statuses
        for kind, response, _ in seen:
            if response.status_code != 503:
                continue
            assert response.headers["Retry-After"].isdigit()
            if kind == "api":
                body = response.json()
                # A 5xx carries the request id the server log has it under (portal.requestid).
                assert set(body) == {"code", "message", "errors", "request_id"} and body["code"] == "unavailable"
                assert body["request_id"] == response.headers["X-Request-Id"]
            else:
                assert response.headers["content-type"].startswith("text/html")
                assert "Traceback" not in response.text and "briefly unavailable" in response.text
        assert stack.proc.poll() is None, "a Hangar process died (manage.py up exits when a child does)"
        assert done["state"] == "succeeded" and done["exit_code"] == 0, done
        assert len(done["attempts"]) == 1, "the job ran once, across the outage"
        assert ended_in_outage["state"] == "succeeded" and len(ended_in_outage["attempts"]) == 1, ended_in_outage
        lines = [line["text"] for line in stack.api("GET", f"/api/v1/jobs/{job['id']}/logs/").json()["lines"]]
        assert "drill3-start" in lines and "drill3-done" in lines
        assert after["state"] == "succeeded", "the scheduler and the agent dispatch again"
        slowest = max(took for _, response, took in seen if response.status_code == 503)
        report(
            3,
            outage_s=outage,
            requests=len(seen),
            answered_503=statuses[503],
            answered_200=statuses[200],
            answered_5xx_other=0,
            slowest_503_s=slowest,
            api_back_after_restart_s=first_ok - down - outage,
            job_across_outage=done["state"],
            attempts=len(done["attempts"]),
        )


# --- drill 7: a log flood read by a viewer that keeps reconnecting -----------------------

# The issue asks for ~30 s. At full speed the agent stored 60k-290k lines a second
# here (it varied between runs) while a viewer replays 6k-12k a second (1,000-line
# batches, 2 shared cores): 8 s gave 0.92M lines and 146 s of reading, so 30 s would
# take far beyond the file's budget. So the flood runs 3 s or 400k lines, whichever
# comes first; HANGAR_DRILL_FLOOD_SECONDS / _MOST_LINES run a bigger one. The 15 s
# lease keeps the drill sharp for a runner that stops renewing while it stores a backlog.
FLOOD_SECONDS = int(os.environ.get("HANGAR_DRILL_FLOOD_SECONDS") or 3)
FLOOD_MOST_LINES = int(os.environ.get("HANGAR_DRILL_FLOOD_MOST_LINES") or 400_000)
# How long the viewer may take to read the flood back once it reconnected five times:
# a 30 s flood is millions of lines, stored at the database's pace, then replayed.
FLOOD_READ_BACK_SECONDS = float(os.environ.get("HANGAR_DRILL_FLOOD_READ_BACK_SECONDS") or 180)
FLOOD = """
import sys, time
end, i, out = time.time() + {seconds}, 0, sys.stdout.buffer
while time.time() < end and i < {most}:
    out.write("".join(f"flood {{n}}\\n" for n in range(i + 1, i + 501)).encode())
    i += 500
out.write(f"flood-total {{i}}\\n".encode())
"""


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listed:
            return [int(p) for p in listed.read().split()]
    except OSError:
        return []


class RssSampler(threading.Thread):
    """The peak resident memory of the stack's processes (web, scheduler, agent), sampled from /proc."""

    def __init__(self, stack: LiveStack):
        super().__init__(daemon=True)
        self.roles = {}
        for pid in children(stack.proc.pid):
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            role = "web" if "portal.webserver" in cmdline else "agent" if cmdline.endswith("agent ") else "scheduler"
            self.roles[role] = pid
        self.peak = dict.fromkeys(self.roles, 0)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.25):
            for role, pid in self.roles.items():
                self.peak[role] = max(self.peak[role], rss_bytes(pid))


def view(stack: LiveStack, job_id: int, cursor: dict, seconds: float) -> tuple[list[dict], dict, bool]:
    """One viewer connection from `cursor`, for `seconds` or until the job's final state."""
    url = f"{stack.ws_url}/ws/jobs/{job_id}/logs/?after_attempt={cursor['attempt']}&after_seq={cursor['seq']}"
    lines, final = [], False
    with connect(url, additional_headers=stack.headers(), open_timeout=10, max_size=None) as ws:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                message = json.loads(ws.recv(timeout=max(0.05, deadline - time.monotonic())))
            except TimeoutError:
                break
            if message["type"] == "lines":
                lines.extend(message["lines"])
                cursor = message["cursor"]
            elif message["type"] == "state" and message["final"]:
                final = True
                break
    return lines, cursor, final


def test_drill_7_log_flood_reaches_a_reconnecting_viewer_exactly_once(tmp_path):
    with services_stack(tmp_path, HANGAR_LEASE_SECONDS="15") as (stack, _, _):
        sampler = RssSampler(stack)
        sampler.start()
        job = stack.submit([PY, "-c", FLOOD.format(seconds=FLOOD_SECONDS, most=FLOOD_MOST_LINES)], name="flood")
        stack.wait_for(job["id"], ("running",), timeout=30)
        began = time.monotonic()
        received, cursor, final, connections = [], {"attempt": 0, "seq": 0}, False, 0
        for _ in range(5):  # disconnect five times while the flood runs, resuming from the cursor
            lines, cursor, final = view(stack, job["id"], cursor, FLOOD_SECONDS / 6)
            received += lines
            connections += 1
            time.sleep(0.3)
        deadline = time.monotonic() + FLOOD_READ_BACK_SECONDS
        while not final and time.monotonic() < deadline:
            lines, cursor, final = view(stack, job["id"], cursor, deadline - time.monotonic())
            received += lines
            connections += 1
        took = time.monotonic() - began
        sampler.done.set()
        done = stack.job(job["id"])

        attempt = done["attempts"][0]["id"]
        low, high, count, distinct = sql(
            stack,
            "SELECT min(seq), max(seq), count(*), count(DISTINCT seq) FROM jobs_logline WHERE attempt_id = %s",
            attempt,
        )[0]
        assert done["state"] == "succeeded" and len(done["attempts"]) == 1, "the flood ran once and succeeded"
        assert (low, high, distinct) == (1, count, count), "stored seq numbers are contiguous 1..N"
        seqs = [line["seq"] for line in received]
        assert seqs == list(range(1, count + 1)), "the viewer got every line exactly once, in order"
        texts = [line["text"] for line in received]
        total = int(next(t for t in texts if t.startswith("flood-total")).split()[1])
        flood = [t for t in texts if t.startswith("flood ")]
        assert flood == [f"flood {n}" for n in range(1, total + 1)], "no output line lost or repeated"
        peak = max(sampler.peak.values())
        assert peak < 1024**3, sampler.peak
        report(
            7,
            flood_s=FLOOD_SECONDS,
            most_lines=FLOOD_MOST_LINES,
            lines=count,
            viewer_connections=connections,
            viewer_done_s=took,
            **{f"peak_rss_{role}_mb": round(value / 2**20) for role, value in sampler.peak.items()},
        )


# --- drill 8: a burst of concurrent submits, replays and cancels ------------------------


SETTLE_SECONDS = float(os.environ.get("HANGAR_DRILL_SETTLE_SECONDS") or 45)


def burst(stack: LiveStack) -> tuple[list[tuple[str, int, dict]], float]:
    """1,000 submits, 50 at a time: 800 plain, of which 200 are cancelled at once, and 100
    idempotency keys sent twice each. Returns (kind, status, body) of every request."""
    client = httpx.Client(
        base_url=stack.url, headers=stack.headers(), timeout=60, limits=httpx.Limits(max_connections=50)
    )
    body = {"project": "default", "command": ["true"]}

    def plain(i: int) -> list:
        submitted = client.post("/api/v1/jobs/", json={**body, "name": f"d8-{i}"})
        out = [("submit", submitted.status_code, submitted.json())]
        if i % 4 == 0 and submitted.status_code == 201:
            cancelled = client.post(f"/api/v1/jobs/{submitted.json()['id']}/cancel/", json={"reason": "drill 8"})
            out.append(("cancel", cancelled.status_code, cancelled.json()))
        return out

    def keyed(i: int) -> list:
        key = f"drill8-key-{i // 2}"
        submitted = client.post("/api/v1/jobs/", json={**body, "name": "d8-keyed"}, headers={"Idempotency-Key": key})
        return [("keyed", submitted.status_code, {**submitted.json(), "key": key})]

    calls = [(plain, i) for i in range(800)] + [(keyed, i) for i in range(200)]
    calls.sort(key=lambda call: (call[1] * 7919) % 1000)  # interleave replays with the plain submits
    began = time.monotonic()
    with client, ThreadPoolExecutor(50) as pool:
        results = [r for rs in pool.map(lambda call: call[0](call[1]), calls) for r in rs]
    return results, time.monotonic() - began


def gpu_overlaps(stack: LiveStack) -> tuple[int, int]:
    """Pairs of attempts that held one GPU of one node at overlapping times (should be none)."""
    rows = sql(stack, "SELECT id, placement, scheduled_at, coalesce(finished_at, now()) FROM jobs_attempt")
    held: dict[tuple[int, int], list[tuple]] = {}
    for attempt, placement, start, end in rows:
        for rank in placement:
            for gpu in rank["gpus"]:
                held.setdefault((rank["node_id"], gpu), []).append((start, end, attempt))
    overlaps = 0
    for spans in held.values():
        spans.sort()
        busy_until = spans[0][1]
        for start, end, _ in spans[1:]:
            overlaps += start < busy_until
            busy_until = max(busy_until, end)
    return overlaps, len(rows)


def test_drill_8_concurrent_submits_make_exactly_the_jobs_asked_for(tmp_path):
    with services_stack(tmp_path, HANGAR_SIM_GPUS="8") as (stack, _, _):
        began = time.monotonic()
        results, took = burst(stack)
        statuses = Counter(status for _, status, _ in results)
        server_errors = sum(n for status, n in statuses.items() if status >= 500)
        assert server_errors == 0, statuses
        # A cancel may come after its `true` job already ended: 409 already_ended, the one other answer.
        ended_first = [body for kind, status, body in results if kind == "cancel" and status == 409]
        assert all(body["code"] == "already_ended" for body in ended_first), ended_first
        assert all(status in (200, 201) for kind, status, _ in results if kind != "cancel" or status != 409), statuses

        keyed: dict[str, set[int]] = {}
        for kind, _, body in results:
            if kind == "keyed":
                keyed.setdefault(body["key"], set()).add(body["id"])
        assert len(keyed) == 100 and all(len(ids) == 1 for ids in keyed.values()), "one job per idempotency key"
        per_key = sql(stack, "SELECT count(*) FROM jobs_job WHERE idempotency_key <> '' GROUP BY idempotency_key")
        assert sorted(n for (n,) in per_key) == [1] * 100
        assert sql(stack, "SELECT count(*) FROM jobs_job")[0][0] == 900

        cancelled = {body["id"] for kind, status, body in results if kind == "cancel" and status == 200}
        assert len(cancelled) + len(ended_first) == 200
        # Ends when every job is final or after a bounded wait (running ~700 jobs of
        # `true` on 2 shared cores takes ~100 s more): the guarantees hold either way.
        deadline = time.monotonic() + SETTLE_SECONDS
        while (settled := job_states(stack)) and sum(settled[s] for s in FINAL) < 900:
            if time.monotonic() > deadline:
                break
            time.sleep(1)
        states = dict(sql(stack, "SELECT id, state FROM jobs_job"))
        assert {states[j] for j in cancelled} <= {"cancelled", "succeeded"}
        assert settled["failed"] == 0, settled
        overlaps, attempts = gpu_overlaps(stack)
        assert overlaps == 0, "a GPU was held by two attempts at once"
        per_job = sql(stack, "SELECT coalesce(max(n), 0) FROM (SELECT count(*) n FROM jobs_attempt GROUP BY job_id) a")
        assert per_job[0][0] <= 1, "no job was started twice"
        report(
            8,
            requests=len(results),
            burst_s=took,
            requests_per_s=len(results) / took,
            status_counts=dict(sorted(statuses.items())),
            jobs=900,
            keys=len(keyed),
            final=sum(settled[s] for s in FINAL),
            succeeded=settled["succeeded"],
            cancelled=settled["cancelled"],
            attempts=attempts,
            gpu_overlaps=overlaps,
            elapsed_s=time.monotonic() - began,
        )
