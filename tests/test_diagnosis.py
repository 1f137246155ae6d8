"""The diagnosis table: real captured outputs (tests/diagnosis_cases/*.json, made by generate.py
from the scripts beside it) and endings that say why by themselves. Pure: no database."""

import json
from pathlib import Path

import pytest

from jobs import diagnosis
from jobs.diagnosis import Ending, Event, Line, diagnose, hang_suspected

CASES = Path(__file__).parent / "diagnosis_cases"


def case(name: str) -> tuple[list[Line], dict]:
    data = json.loads((CASES / f"{name}.json").read_text())
    lines = [Line(x["seq"], x["text"], x["rank"], f"node-{x['rank']}", x["stream"], 7) for x in data["lines"]]
    return lines, data


def failed(data: dict, **fields) -> Ending:
    codes = [c for c in data["exit_codes"].values() if c]
    return Ending(exit_code=codes[0] if codes else 0, world_size=data["world_size"], **fields)


# case, category, first failing rank, what the summary names, what the hint names
TABLE = [
    ("host_oom_rlimit", "host_oom", 0, "tried to allocate 4.00 GiB", "host (CPU) memory"),
    ("host_oom_memoryerror", "host_oom", 0, "host memory exhausted", "host (CPU) memory"),
    ("nan_loss", "nan_loss", 0, "loss", "learning rate"),
    ("nan_anomaly", "nan_loss", 0, "returned nan values", "clip gradients"),
    ("module_not_found", "import_error", 0, "No module named 'transformerz'", "'transformerz' is not installed"),
    ("file_not_found", "file_not_found", 0, "data/train.csv", "working directory"),
    ("permission_denied", "permission", 0, "Permission denied: '/root/.hangar-not-yours'", "may not read or write"),
    ("deep_torch", "python_exception", 0, "train.py:12 in forward", "mat1 and mat2 shapes"),
    ("segfault", "segfault", None, "SIGSEGV", "PYTHONFAULTHANDLER"),
    ("segfault_faulthandler", "segfault", 0, "Segmentation fault", "PYTHONFAULTHANDLER"),
    ("gloo_peer_raises", "python_exception", 1, "KeyError: 'batch_size' (train.py:13 in <module>)", "KeyError"),
    ("gloo_peer_vanishes", "network_error", 0, "Connection reset by peer", "another rank failed first"),
    ("gloo_timeout", "collective_timeout", 0, "Timed out waiting 3000ms", "same collectives in the same order"),
    ("gloo_abort_after_destroy", "abort", 1, "aborted at exit after its last output", "dist.barrier()"),
]


@pytest.mark.parametrize(("name", "category", "rank", "summary", "hint"), TABLE, ids=[t[0] for t in TABLE])
def test_real_outputs_are_diagnosed(name, category, rank, summary, hint):
    lines, data = case(name)

    found = diagnose(lines, failed(data))

    assert found.category == category, found
    assert found.first_failing_rank == rank
    assert summary in found.summary and hint in found.hint, found
    if rank is not None:
        assert found.evidence and all(e["attempt"] == 7 and e["seq"] > 0 for e in found.evidence)
        assert found.evidence[0]["rank"] == rank


def test_the_deepest_frame_named_is_the_users_not_the_librarys():
    lines, data = case("deep_torch")

    found = diagnose(lines, failed(data))

    assert "site-packages" not in found.summary and "train.py:12" in found.summary
    assert any("self.fc2(torch.relu" in e["text"] or "train.py" in e["text"] for e in found.evidence)


def test_a_warning_in_the_output_is_not_an_error():
    lines, data = case("gloo_abort_after_destroy")
    rank0 = [x for x in lines if x.rank == 0]  # a UserWarning and "done": rank 0 exited 0

    found = diagnose(rank0, Ending(exit_code=1))

    assert found.category == "unknown" and found.confidence == "low"
    assert "exited with code 1; no known error" in found.summary


def test_a_cuda_oom_names_what_was_tried_and_what_was_free():
    # torch's message (c10/cuda/CUDACachingAllocator.cpp); this machine has no CUDA GPU to capture one
    # (bench/real_gpu.py diagnoses a real one where there is).
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 3.50 GiB is free. Including non-PyTorch memory, this process has 75.68 GiB memory in use."
    )
    frame = '  File "/tmp/hangar-job-x/train.py", line 9, in <module>'
    lines = [Line(1, "Traceback (most recent call last):"), Line(2, frame),
             Line(3, "    x = torch.empty(big, device='cuda')"), Line(4, text, stream="stderr")]  # fmt: skip

    found = diagnose(lines, Ending(exit_code=1))

    assert found.category == "cuda_oom"
    assert "tried to allocate 20.00 GiB" in found.summary and "3.50 GiB free" in found.summary
    assert found.hint.startswith("Asked for 20.00 GiB with 3.50 GiB free")


@pytest.mark.parametrize(
    ("ending", "events", "category"),
    [
        (Ending("cancelled", "cancelled", 143, "cancelled by owner"), [], "cancelled"),
        (Ending("preempted", "preempted", 143, "preempted to make room for job 9"), [], "preempted"),
        (Ending("failed", "timeout", 143, "exceeded max runtime of 60s", max_runtime_seconds=60), [], "timeout"),
        (Ending("lost", "infra", None, "node node-b went offline: no heartbeat"), [], "node_lost"),
        (Ending("lost", "infra", None, "lease expired: agent silent"), [], "node_lost"),
        (
            Ending("failed", "infra", 143, "health: GPU 1: 1 uncorrectable ECC errors"),
            [Event("ecc", "GPU 1: 1 uncorrectable ECC errors", "node-a", "cordoned, job stopped")],
            "gpu_fault",
        ),  # fmt: skip
        (
            Ending("failed", "infra", 1, "exited with code 1 after a health event on its GPUs: NCCL"),
            [Event("nccl", "NCCL reported an unhandled error", "node-a", "cordoned, job stopped", "output")],
            "network_error",
        ),
        (Ending("failed", "user", 137, "killed by SIGKILL (exit code 137)", memory_limit_mb=2048), [], "host_oom"),
        (Ending("failed", "user", 3, "exited with code 3"), [], "unknown"),
    ],
)
def test_endings_that_say_why_by_themselves(ending, events, category):
    found = diagnose([], ending, events)

    assert found.category == category, found
    assert found.hint


def test_a_gpu_fault_only_the_jobs_output_claims_is_not_presented_as_fact():
    lines = [Line(1, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", stream="stdout")]
    suspicion = Event("xid", "Xid 79 in the job's output", "node-a", "suspected", "output")

    found = diagnose(lines, Ending(exit_code=3), [suspicion])

    assert found.category == "gpu_fault" and found.confidence == "low"
    assert "not corroborated" in found.summary


def test_every_category_has_a_name():
    assert len(set(diagnosis.CATEGORIES)) == 19


@pytest.mark.parametrize(
    ("last", "idle", "silent"),
    [
        ({0: 95.0, 1: 10.0}, None, (1,)),  # rank 1 silent while rank 0 prints
        ({0: 95.0, 1: 94.0}, None, None),
        ({0: 10.0, 1: 10.0}, None, None),  # all silent, GPUs unknown: no claim
        ({0: 10.0, 1: 10.0}, False, None),  # all silent, GPUs busy: computing
        ({0: 10.0, 1: 10.0}, True, (0, 1)),  # all silent, GPUs idle
        ({0: 95.0}, None, (1,)),  # rank 1 never printed
    ],
)
def test_a_hang_is_suspected_when_a_rank_is_silent(last, idle, silent):
    hang = hang_suspected(last, now=100.0, started=0.0, hang_seconds=30, world_size=2, gpus_idle=idle)

    assert (hang.ranks if hang else None) == silent


def test_no_hang_before_the_attempt_ran_that_long():
    assert hang_suspected({}, now=10.0, started=0.0, hang_seconds=30, world_size=2) is None


def test_an_nccl_error_only_the_jobs_output_claims_has_low_confidence():
    lines = [Line(1, "host:1:2 [0] NCCL WARN Call to ibv_post_send failed: unhandled system error", stream="stderr")]
    suspicion = Event("nccl", "NCCL reported an unhandled error", "node-a", "suspected, job stopped", "output")

    found = diagnose(lines, Ending(exit_code=3), [suspicion])

    assert found.category == "network_error" and found.confidence == "low"
    assert "reported only by the job's output" in found.summary


def test_an_nccl_watchdog_timeout_that_aborts_the_process_is_a_collective_timeout():
    # The shape of torch's NCCL watchdog output (ProcessGroupNCCL.cpp); no NCCL on this machine to capture it.
    texts = [
        "[rank1]:[E1201 09:12:00.000000 123 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1024, Timeout(ms)=600000) ran for "
        "600012 milliseconds before timing out.",
        "terminate called after throwing an instance of 'c10::DistBackendError'",
        "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with exception",
    ]
    lines = [Line(i, t, rank=1, stream="stderr") for i, t in enumerate(texts, 1)]

    found = diagnose(lines, Ending(exit_code=134, world_size=2))

    assert found.category == "collective_timeout" and found.first_failing_rank == 1
    assert "dist.barrier()" not in found.hint


def test_a_peer_that_vanished_without_a_word_is_named_first_failing_rank():
    lines, data = case("gloo_peer_vanishes")
    # What rank 1's agent writes when its process exits (agent/runner.py Runner.exited), stored
    # before rank 0 reports the lost connection.
    error = next(x for x in lines if x.rank == 0 and "Connection reset by peer" in x.text)
    exited = Line(error.seq, "[hangar] exited with code 1", 1, "node-1", "system", 7)
    lines = [x if x.seq < error.seq else Line(x.seq + 1, x.text, x.rank, x.node, x.stream, 7) for x in lines]

    found = diagnose([*lines, exited], failed(data))

    assert found.category == "network_error" and found.first_failing_rank == 1
    assert found.summary.startswith("rank 1 exited with code 1 first, with no error in its output")
    assert found.evidence[0]["text"] == "[hangar] exited with code 1"


@pytest.mark.parametrize(
    ("steps", "slow"),
    [
        ({0: 100, 1: 98, 2: 60}, (2,)),
        ({0: 100, 1: 97}, None),  # within the fraction
        ({0: 4, 1: 1}, None),  # too early to tell
        ({0: 100}, None),
    ],
)
def test_a_straggler_is_a_rank_whose_step_lags_the_leader(steps, slow):
    found = diagnosis.straggling(steps)

    assert (found.ranks if found else None) == slow


def test_step_numbers_are_read_from_training_lines():
    assert [diagnosis.step_of(t) for t in ("step 120 loss 0.3", "iter=7", "global_step: 9", "epoch 1")] == [
        120,
        7,
        9,
        None,
    ]
