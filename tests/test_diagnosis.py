"""The diagnosis table: real outputs captured from running programs (tests/diagnosis_cases/*.json,
made by capture.py from the scripts and sources beside it), and endings that say why by
themselves. Pure: no database."""

import subprocess
import time

import pytest

from jobs import diagnosis
from jobs.diagnosis import Ending, Event, Line, RankExit, diagnose, hang_suspected, wanted_files
from tests.diagnosis_cases import capture, cases

NAMES = cases.names()


@pytest.mark.parametrize("name", NAMES)
def test_real_outputs_are_diagnosed(name):
    case, found = cases.diagnosed(name)
    want = case["expect"]

    assert found.category == want["category"], found
    assert found.first_failing_rank == want["rank"], found
    assert want["summary"] in found.summary and want["hint"] in found.hint, found
    assert found.hint and found.confidence in ("high", "medium", "low")
    if want["rank"] is not None:
        assert found.evidence and all(e["attempt"] == cases.ATTEMPT and e["seq"] > 0 for e in found.evidence)
        assert found.evidence[0]["rank"] == want["rank"]


def test_the_cases_are_real_captures_of_every_kind_of_failure():
    table = {case.name: case for case in capture.CASES}

    assert len(NAMES) >= 40 and set(NAMES) == set(table)  # every case file is one capture.py makes, and back
    for name in NAMES:
        case = cases.load(name)
        assert case["lines"] and case["exits"] and case["generated_with"].startswith("python 3"), name
        assert {int(r) for r in case["exits"]} == set(range(case["world_size"])), name
        expected = table[name]
        assert case["expect"] == {"category": expected.category, "rank": expected.rank, "summary": expected.summary,
                                  "hint": expected.hint}, name  # fmt: skip
    categories = {case.category for case in capture.CASES}
    assert categories >= {"syntax_error", "environment", "host_oom", "disk_full", "interrupted", "script_exit",
                          "usage_error", "nan_loss", "python_exception", "import_error"}  # fmt: skip


def test_precision_is_one_in_every_category(capsys):
    table = cases.precision()
    with capsys.disabled():
        print("\n" + cases.table())

    assert all(right == said for right, said, _ in table.values()), table
    assert all(right == want for right, _, want in table.values()), table  # and every case found


# --- echoed source is never evidence of anything ---------------------------------------------------


def test_a_syntax_error_whose_line_says_nan_is_a_syntax_error_naming_the_line():
    case, found = cases.diagnosed("syntax_error_nan")

    assert found.category == "syntax_error"
    assert "train.py:5" in found.summary and "`loss = nan if step == 0 els 1.0`" in found.summary
    assert "expected 'else' after 'if' expression" in found.hint


@pytest.mark.parametrize("name", NAMES)
def test_no_echoed_source_line_is_ever_evidence(name):
    _, found = cases.diagnosed(name)

    for e in found.evidence:
        text = diagnosis.strip(e["text"])
        assert not (text.startswith("    ") and not text.lstrip().startswith("File ")), e
        assert text.strip() and not set(text.strip()) <= set("^~"), e


def test_a_nan_printed_before_another_error_is_not_the_diagnosis():
    case, found = cases.diagnosed("nan_printed_then_keyerror")
    assert any("loss nan" in x["text"] for x in case["lines"])  # the setup: a NaN was printed first

    assert found.category == "python_exception" and "KeyError: 'val_loss'" in found.summary


def test_a_nan_printed_before_a_silent_failure_is_the_diagnosis():
    lines = [Line(1, "step 0 loss 2.31"), Line(2, "step 1 loss nan")]

    found = diagnose(lines, Ending(exit_code=1))

    assert found.category == "nan_loss" and found.first_failing_rank == 0


# --- code run by exec ---------------------------------------------------------------------------------


def test_a_frame_in_an_execd_config_names_the_file_and_quotes_its_line():
    case, found = cases.diagnosed("nanogpt_config_nameerror")

    assert found.summary == (
        "NameError: name 'warmup_ratio' is not defined (config/train_shakespeare_char.py:14 in <module>)"
    )
    assert "`warmup_iters = warmup_ratio * max_iters`" in found.hint


def test_the_files_wanted_are_the_commands_and_those_execd_by_name():
    case = cases.load("nanogpt_config_nameerror")
    lines = cases.lines_of(case)

    wanted = wanted_files(lines, tuple(case["command"]))

    assert wanted == ["train.py", "config/train_shakespeare_char.py", "configurator.py"]
    assert wanted_files(cases.lines_of(cases.load("key_error")), ("python", "train.py")) == []


def test_without_the_files_a_string_frame_stays_unnamed():
    case = cases.load("nanogpt_config_nameerror")
    lines, exits = cases.lines_of(case), cases.exits_of(case)

    found = diagnose(lines, cases.ending_of(case, exits), exits=exits)

    assert found.category == "python_exception" and "(<string>:14 in <module>)" in found.summary


def test_a_file_that_does_not_hold_the_name_is_not_blamed():
    case = cases.load("nanogpt_config_nameerror")
    lines, exits = cases.lines_of(case), cases.exits_of(case)
    files = {"configurator.py": case["files"]["configurator.py"], "config/other.py": "x = 1\n" * 20}

    found = diagnose(lines, cases.ending_of(case, exits), exits=exits, files=files)

    assert "(<string>:14 in <module>)" in found.summary and "config/other.py" not in found.summary


# --- the first failing rank from the ranks' exits --------------------------------------------------------


def test_the_rank_the_oom_killer_took_first_is_named_from_its_exit_not_the_line_order():
    case, found = cases.diagnosed("gloo_rank_oom_killed")
    exits = cases.exits_of(case)
    assert exits[1].code == 137 and exits[1].at < exits[0].at  # the setup: rank 1 was killed first
    assert any(x["rank"] == 0 and "Connection closed by peer" in x["text"] for x in case["lines"])

    assert found.category == "host_oom" and found.first_failing_rank == 1
    assert "rank 1 was killed by SIGKILL (exit code 137) first" in found.summary

    by_lines = diagnose(cases.lines_of(case), cases.ending_of(case, exits))  # no exits: line order alone
    assert (by_lines.category, by_lines.first_failing_rank) == ("network_error", 0)


def test_of_two_ranks_that_both_failed_the_first_to_exit_is_the_first_failing_rank():
    # Two real failures as two ranks of one attempt; rank 0's lines happen to be stored first.
    first = cases.lines_of(cases.load("key_error"))
    second = [Line(len(first) + x.seq, x.text, 1, "node-1", x.stream, 7)
              for x in cases.lines_of(cases.load("zero_division"))]  # fmt: skip
    lines, ending = first + second, Ending(exit_code=1, world_size=2)

    assert diagnose(lines, ending).first_failing_rank == 0  # by stored order
    found = diagnose(lines, ending, exits={0: RankExit(1, at=100.4), 1: RankExit(1, at=100.1)})
    assert found.first_failing_rank == 1 and "ZeroDivisionError" in found.summary


def test_what_a_rank_prints_while_the_agent_stops_it_is_no_cause():
    # Rank 0 fails on its own; the agent then stops rank 1, which prints a KeyboardInterrupt.
    failed = cases.lines_of(cases.load("key_error"))
    stopped = cases.lines_of(cases.load("keyboard_interrupt"))
    stop = Line(len(failed) + 1, "[hangar] stopping: the attempt ended elsewhere (SIGTERM, then SIGKILL after 5s)",
                1, "node-1", "system", 7)  # fmt: skip
    lines = failed + [stop] + [Line(len(failed) + 1 + x.seq, x.text, 1, "node-1", x.stream, 7) for x in stopped]

    found = diagnose(lines, Ending(exit_code=1, world_size=2), exits={0: RankExit(1, 10.0), 1: RankExit(130, 11.0)})

    assert found.category == "python_exception" and found.first_failing_rank == 0, found


def test_a_peer_that_vanished_without_a_word_is_named_first_failing_rank():
    case = cases.load("gloo_peer_vanishes")
    lines = cases.lines_of(case)
    # What rank 1's agent writes when its process exits (agent/runner.py Runner.exited), stored
    # before rank 0 reports the lost connection.
    error = next(x for x in lines if x.rank == 0 and "Connection reset by peer" in x.text)
    exited = Line(error.seq, "[hangar] exited with code 1", 1, "node-1", "system", 7)
    lines = [x if x.seq < error.seq else Line(x.seq + 1, x.text, x.rank, x.node, x.stream, 7) for x in lines]

    found = diagnose([*lines, exited], Ending(exit_code=1, world_size=2))

    assert found.category == "network_error" and found.first_failing_rank == 1
    assert found.summary.startswith("rank 1 exited with code 1 first, with no error in its output")
    assert found.evidence[0]["text"] == "[hangar] exited with code 1"


# --- launches the agent reports --------------------------------------------------------------------------


def test_a_command_the_agent_could_not_start_is_the_environments():
    try:  # the agent's line, from the real error (agent/runner.py: could not start {command[0]!r}: {strerror})
        subprocess.Popen(["hangar-no-such-python", "train.py"])
    except FileNotFoundError as exc:
        text = f"[hangar] could not start 'hangar-no-such-python': {exc.strerror}"
    lines = [Line(1, "[hangar] attempt 1 on node node-a, GPUs 0", stream="system"), Line(2, text, stream="system")]

    found = diagnose(lines, Ending(exit_code=127, reason=text.removeprefix("[hangar] ")))

    assert found.category == "environment" and found.first_failing_rank == 0
    assert "No such file or directory" in found.summary and "PATH" in found.hint


def test_a_silent_exit_127_is_the_environments_with_medium_confidence():
    found = diagnose([], Ending(exit_code=127))

    assert (found.category, found.confidence) == ("environment", "medium")


# --- what the output cannot show -----------------------------------------------------------------------


def test_a_warning_in_the_output_is_not_an_error():
    lines = [x for x in cases.lines_of(cases.load("gloo_abort_after_destroy")) if x.rank == 0]
    assert any("UserWarning" in x.text for x in lines)  # rank 0 printed a warning and "done", then exited 0

    found = diagnose(lines, Ending(exit_code=1))

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
    texts = ["Traceback (most recent call last):", frame, "    x = torch.empty(big, device='cuda')", text]
    lines = [Line(i, t, stream="stderr") for i, t in enumerate(texts, 1)]

    found = diagnose(lines, Ending(exit_code=1))

    assert found.category == "cuda_oom"
    assert "tried to allocate 20.00 GiB" in found.summary and "3.50 GiB free" in found.summary
    assert found.hint.startswith("Asked for 20.00 GiB with 3.50 GiB free")


def test_a_frame_in_a_code_snapshots_copy_is_named_relative_to_it():
    frame = '  File "/var/hangar/jobs/42/code-1-0/src/model.py", line 3, in forward'
    lines = [Line(1, "Traceback (most recent call last):"), Line(2, frame), Line(3, "    return x @ w"),
             Line(4, "ValueError: bad shape")]  # fmt: skip

    assert "(src/model.py:3 in forward)" in diagnose(lines, Ending(exit_code=1)).summary


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
        (Ending("failed", "user", 143, "killed by SIGTERM (exit code 143)"), [], "interrupted"),
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


def test_every_category_has_a_stable_name():
    assert len(set(diagnosis.CATEGORIES)) == len(diagnosis.CATEGORIES) == 24
    # The names the API has carried so far keep their places (they are API).
    assert diagnosis.CATEGORIES[:19] == (
        "cuda_oom", "host_oom", "nan_loss", "collective_timeout", "network_error", "gpu_fault", "python_exception",
        "import_error", "file_not_found", "permission", "segfault", "abort", "timeout", "cancelled", "preempted",
        "node_lost", "hang", "environment", "unknown",
    )  # fmt: skip


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


# --- a job's output cannot hold the process that reads it -------------------------------------------------

LINE = 16 * 1024  # the agent's default line limit (HANGAR_LOG_LINE_MAX_BYTES)
# Each held a backtracking engine for seconds, in the agent's thread or the scheduler's reconciler.
CRAFTED_MESSAGES = [
    "NCCL WARN " * (LINE // 10),
    "a.so" * (LINE // 4),
    "DataLoader worker (pid 1) is killed by signal: a" + " " * LINE + "x",
]
CRAFTED_QUIET = "2024-01-01" + " " * LINE + "x Warning: slow"  # a warning: no message, read through to the end
CRAFTED_STEP = "step" + " " * LINE + "x"


def crafted_traceback(seq: int, message: str) -> list[Line]:
    texts = ["Traceback (most recent call last):", '  File "/tmp/hangar-job-x/train.py", line 3, in <module>',
             "    step()", f"RuntimeError: {message}"]  # fmt: skip
    return [Line(seq + i, text, stream="stderr") for i, text in enumerate(texts)]


def test_crafted_exception_messages_are_read_in_linear_time():
    lines = [x for i, message in enumerate(CRAFTED_MESSAGES * 3) for x in crafted_traceback(10 * i + 1, message)]

    started = time.monotonic()
    found = diagnose(lines, Ending(exit_code=1))

    assert time.monotonic() - started < 1.0
    assert found.category == "python_exception" and found.summary.startswith("RuntimeError: NCCL WARN")


def test_crafted_lines_without_a_message_are_read_in_linear_time():
    lines = [Line(i, CRAFTED_QUIET, stream="stderr") for i in range(1, 6)]

    started = time.monotonic()
    found = diagnose(lines, Ending(exit_code=1))
    steps = [diagnosis.step_of(CRAFTED_STEP) for _ in range(3)]

    assert time.monotonic() - started < 1.0
    assert found.category == "unknown" and steps == [None] * 3


def test_a_traceback_of_many_string_frames_reads_each_file_once():
    # As many files as jobs/diagnosing.py reads, each as large as it reads them; frames a job can print at will.
    files = {f"config/c{i}.py": "x = 1\n" * (256 * 1024 // 6) for i in range(8)}
    texts = ["Traceback (most recent call last):", *['  File "<string>", line 5, in <module>'] * 390,
             "NameError: name 'y' is not defined"]  # fmt: skip
    lines = [Line(i, text, stream="stderr") for i, text in enumerate(texts, 1)]

    started = time.monotonic()
    found = diagnose(lines, Ending(exit_code=1, command=("python", "train.py", *files)), files=files)

    assert time.monotonic() - started < 3.0
    assert found.category == "python_exception" and "NameError" in found.summary


# --- hangs and stragglers ----------------------------------------------------------------------------------


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
