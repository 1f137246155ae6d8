"""Gang jobs and preemption end to end: a real `manage.py up` plus a second node
agent, real job processes, a real torch.distributed (gloo, CPU) all-reduce.

Services mode needs PostgreSQL and Redis; under CI (CI=true) their absence is a
failure, elsewhere those tests are skipped with the reason.
"""

import sys
import textwrap
import time

import pytest

from tests.factories import services_database
from tests.livestack import LiveStack

pytestmark = pytest.mark.e2e
torch = pytest.importorskip("torch", reason="torch==2.13.0 (CPU) is in requirements-test.txt")

PY = sys.executable
ENV = {"HANGAR_PREEMPT_GRACE_SECONDS": "5", "HANGAR_SCHEDULER_INTERVAL": "0.5"}


@pytest.fixture(scope="module", params=["embedded", "services"])
def stack(request, tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp(f"sched-{request.param}"))
    if request.param == "embedded":
        with LiveStack(env=ENV, data_dir=data_dir) as live:
            live.start_agent("node-b", gpus=4)
            yield live
        return
    services = services_database()
    with services as env, LiveStack(env={**env, **ENV}, data_dir=data_dir) as live:
        live.start_agent("node-b", gpus=4)
        yield live


def script(body: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(body)]


def all_lines(stack: LiveStack, job_id: int) -> list[dict]:
    return stack.api("GET", f"/api/v1/jobs/{job_id}/logs/?limit=5000").json()["lines"]


ALL_REDUCE = """
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from Hangar
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"rank={rank} world={world} node={os.environ['HANGAR_NODE']} sum={value.item():g}", flush=True)
    dist.barrier()  # see TRAPS.md: gloo can abort at exit without it
    dist.destroy_process_group()
"""


def test_a_two_node_torch_distributed_job_all_reduces_and_succeeds(stack):
    job = stack.submit(script(ALL_REDUCE), name="allreduce", nodes=2, gpus_per_node=2)

    done = stack.wait_for(job["id"], ("succeeded", "failed", "cancelled"), timeout=180)

    lines = all_lines(stack, job["id"])
    assert done["state"] == "succeeded", lines
    (attempt,) = done["attempts"]
    assert sorted(r["node"] for r in attempt["placement"]) == ["node-a", "node-b"]
    results = sorted((line["rank"], line["node"], line["text"]) for line in lines if line["text"].startswith("rank="))
    assert [(rank, text.split()[-1]) for rank, _, text in results] == [(0, "sum=3"), (1, "sum=3")]
    by_rank = {rank: node for rank, node, _ in results}
    assert {by_rank[r["rank"]] for r in attempt["placement"]} == {"node-a", "node-b"}
    assert all(f"node={node}" in text for _, node, text in results)  # tagged with the node that ran it
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))


def test_one_failing_rank_stops_the_other_and_ends_the_attempt(stack):
    body = """
        import os, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(7)
        print("rank 0 waiting", flush=True)
        time.sleep(120)
    """
    job = stack.submit(script(body), nodes=2, gpus_per_node=1, max_runtime_seconds=300)

    started = time.monotonic()
    done = stack.wait_for(job["id"], ("succeeded", "failed", "cancelled"), timeout=60)

    assert (done["state"], done["exit_code"], done["failure_class"]) == ("failed", 7, "user")
    assert time.monotonic() - started < 45  # rank 0 did not sleep its 120 s out


CHECKPOINTING = """
    import os, pathlib, signal, sys, time
    ckpt = pathlib.Path(os.environ["HANGAR_CHECKPOINT_DIR"]) / f"step-{os.environ['RANK']}"
    step = int(ckpt.read_text()) if ckpt.exists() else 0
    if step:
        print(f"resumed from step {step}", flush=True)
        sys.exit(0)

    def stop(signum, frame):
        ckpt.write_text(str(step))
        print(f"SIGTERM: checkpoint at step {step}", flush=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, stop)
    print("training", flush=True)
    while True:
        step += 1
        time.sleep(0.05)
"""


def test_a_preempted_scavenger_checkpoints_and_resumes_after_the_urgent_job(stack):
    scavenger = stack.submit(script(CHECKPOINTING), name="scavenger", priority="scavenger", nodes=2, gpus_per_node=4)
    stack.wait_for(scavenger["id"], ("running",), timeout=60)
    deadline = time.monotonic() + 60
    # Both ranks: one still starting when the SIGTERM comes has no handler yet, so no checkpoint.
    while {line["rank"] for line in all_lines(stack, scavenger["id"]) if line["text"] == "training"} != {0, 1}:
        assert time.monotonic() < deadline, "the scavenger's ranks never both started training"
        time.sleep(0.2)

    urgent = stack.submit(
        script("import time; time.sleep(1); print('urgent done')"), priority="urgent", gpus_per_node=4
    )
    urgent_done = stack.wait_for(urgent["id"], ("succeeded", "failed", "cancelled"), timeout=90)
    done = stack.wait_for(scavenger["id"], ("succeeded", "failed", "cancelled"), timeout=90)

    assert urgent_done["state"] == "succeeded"
    assert done["state"] == "succeeded", all_lines(stack, scavenger["id"])
    first, second = done["attempts"]
    assert (first["state"], first["failure_class"]) == ("preempted", "preempted")
    assert f"job {urgent['id']}" in first["reason"]
    assert second["state"] == "succeeded" and second["scheduled_at"] >= urgent_done["finished_at"]
    texts = [line["text"] for line in all_lines(stack, scavenger["id"])]
    assert any(t.startswith("SIGTERM: checkpoint at step") for t in texts)
    resumed = [int(t.split()[-1]) for t in texts if t.startswith("resumed from step")]
    assert len(resumed) == 2 and all(step > 0 for step in resumed)
    assert done["preemptions"] == 1 and done["retries"] == 0


def test_sixty_short_jobs_back_to_back_each_run_once_and_never_share_a_gpu(stack):
    from datetime import datetime

    ids = [stack.submit(["echo", f"short {i}"], name=f"short-{i}", gpus_per_node=1)["id"] for i in range(60)]
    jobs = [stack.wait_for(job_id, ("succeeded", "failed", "cancelled"), timeout=180) for job_id in ids]

    assert [job["state"] for job in jobs] == ["succeeded"] * 60
    assert [len(job["attempts"]) for job in jobs] == [1] * 60
    held: dict[tuple[str, int], list[tuple[datetime, datetime]]] = {}
    for job in jobs:
        attempt = job["attempts"][0]
        span = tuple(datetime.fromisoformat(attempt[k].replace("Z", "+00:00")) for k in ("started_at", "finished_at"))
        for rank in attempt["placement"]:
            for gpu in rank["gpus"]:
                held.setdefault((rank["node"], gpu), []).append(span)
    for spans in held.values():  # from preflight to the recorded end: one live attempt per GPU at a time
        spans.sort()
        assert all(before[1] <= after[0] for before, after in zip(spans, spans[1:], strict=False))
