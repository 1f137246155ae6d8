"""Logs end to end on a real stack, embedded and services mode: ranks on several agents
writing one attempt at once, and a filtered follower that is cut off again and again."""

import subprocess
import sys
import textwrap

import pytest

from tests.livestack import BASE_DIR
from tests.test_e2e_skeleton import follow_logs, script, stack  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

EXTRA_RANK = """
import queue, sys
from django.utils import timezone
from fleet.models import Node
from agent.output import LogWriter
from jobs.models import Attempt
rank = {rank}
defaults = dict(gpu_model="H100", gpu_count=1, state="offline")
node, _ = Node.objects.get_or_create(name=f"rank-node-{{rank}}", defaults=defaults)
attempt = Attempt.objects.get(job_id={job_id}, state="running")
lines = queue.Queue()
writer = LogWriter(attempt, lines, rank=rank, node_id=node.pk)
writer.start()
for burst in range(20):
    for i in range(burst * 100, burst * 100 + 100):
        lines.put((1, timezone.now(), f"rank {{rank}} line {{i}}\\n".encode(), False))
writer.close()
print("stored", writer.seq)
"""


def all_lines(live, job_id: int, **filters) -> list[dict]:
    lines, cursor = [], {"attempt": 0, "seq": 0}
    while True:
        params = {"after_attempt": cursor["attempt"], "after_seq": cursor["seq"], "limit": 5000, **filters}
        page = live.api("GET", f"/api/v1/jobs/{job_id}/logs/", params=params).json()
        lines += page["lines"]
        cursor = page["cursor"]
        if not page["more"]:
            return lines


def test_ranks_writing_one_attempt_at_once_get_one_gap_free_sequence(stack):  # noqa: F811
    job = stack.submit(
        script(
            """
            import os, time
            for i in range(2000):
                print(f"rank 0 line {i}", flush=True)
                if i % 20 == 0:
                    time.sleep(0.05)
            deadline = time.time() + 150  # rank 0 stays running until the extra ranks wrote
            while not os.path.exists("extra-ranks-done") and time.time() < deadline:
                time.sleep(0.1)
            """
        ),
        name="ranks",
    )
    done = stack.data_dir / "jobs" / str(job["id"]) / "extra-ranks-done"  # in its own directory: it sees that
    stack.wait_for(job["id"], ("running",))
    ranks = [
        subprocess.Popen(
            [sys.executable, "manage.py", "shell", "-c", textwrap.dedent(EXTRA_RANK.format(rank=r, job_id=job["id"]))],
            cwd=BASE_DIR,
            env=stack.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (1, 2)
    ]
    try:
        for proc in ranks:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0 and "stored" in out, out
    finally:
        done.touch()
    assert stack.wait_for(job["id"], ("succeeded", "failed"), timeout=60)["state"] == "succeeded"

    lines = all_lines(stack, job["id"])
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    for rank in (0, 1, 2):
        texts = [line["text"] for line in lines if line["rank"] == rank and line["stream"] == "stdout"]
        assert texts == [f"rank {rank} line {i}" for i in range(2000)], rank
    assert {line["node"] for line in lines if line["rank"] == 2} == {"rank-node-2"}


def test_a_filtered_follower_cut_off_again_and_again_gets_each_match_once(stack):  # noqa: F811
    job = stack.submit(
        script(
            """
            import time
            for i in range(300):
                print(f"keep {i}", flush=True)
                print(f"skip {i}", flush=True)
                if i % 30 == 0:
                    time.sleep(0.1)
            """
        )
    )
    seen, cursor, final = [], {"attempt": 0, "seq": 0}, None
    while final is None:
        batch, final = follow_logs(stack, job["id"], after=cursor, stop_after=25, filters="&q=keep")
        seen += batch
        if batch:
            cursor = {"attempt": batch[-1]["attempt"], "seq": batch[-1]["seq"]}

    assert [line["text"] for line in seen] == [f"keep {i}" for i in range(300)]
    assert all(line["hl"] == [[0, 4]] for line in seen)
