"""A diagnosis is stored with every attempt that ends badly, and shown in the API; hangs are flagged."""

import sys
import time
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from agent import runner as execution
from agent import running
from fleet.models import GPU
from jobs import diagnosing, diagnosis, scheduler
from jobs.models import Attempt, AttemptState, FailureClass, Job, JobEvent, JobState, LogLine, Stream
from tests.diagnosis_cases import cases
from tests.factories import api_client, make_attempt, make_job, make_node, make_snapshot


@pytest.fixture
def node(transactional_db):
    running.CURRENT = None
    node = make_node("node-a", gpus=1)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    return node


def run(project, owner, code: str, **fields) -> Attempt:
    make_job(project, owner, command=[sys.executable, "-c", code], **fields)
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)
    return Attempt.objects.get(pk=attempt.pk)


def test_a_failed_attempt_carries_its_diagnosis_in_the_api(node, project, owner):
    attempt = run(project, owner, "print('starting', flush=True)\nimport transformerz")

    found = diagnosing.wait_for(attempt.pk)
    assert found["category"] == "import_error" and "transformerz" in found["summary"]
    seq = found["evidence"][0]["seq"]
    assert "ModuleNotFoundError" in LogLine.objects.get(attempt=attempt, seq=seq).text
    body = api_client(owner).get(f"/api/v1/jobs/{attempt.job_id}/").json()
    assert body["diagnosis"]["category"] == "import_error"
    assert body["attempts"][0]["diagnosis"] == body["diagnosis"]
    assert body["hang_suspected"] is None
    browser = Client()
    browser.force_login(owner)
    page = browser.get(f"/jobs/{attempt.job_id}/").content.decode()
    assert 'id="job-diagnosis"' in page and "Jump to evidence" in page and f'data-seq="{seq}"' in page
    from hangar.cli import describe

    printed = describe(body)
    assert "why:      import_error: ModuleNotFoundError" in printed and "hint:" in printed
    from jobs import tracking

    job = attempt.job.__class__.objects.get(pk=attempt.job_id)
    assert job.mlflow_run_id, job.tracking_error
    if tracking.enabled():  # the run carries it too
        tags = tracking.client().get_run(job.mlflow_run_id).data.tags
        assert tags["hangar.diagnosis.category"] == "import_error" and "transformerz" in tags["hangar.diagnosis"]


CONFIGURATOR = cases.load("nanogpt_config_nameerror")["files"]["configurator.py"]
TRAIN = """\
batch_size = 12
warmup_iters = 100
exec(open("configurator.py").read())
print("training", batch_size, flush=True)
"""
CONFIG = "batch_size = 64\nlearning_rate = 1e-3\nmax_iters = 5000\nwarmup_iters = warmup_ratio * max_iters\n"


@pytest.fixture
def node_dirs(node, settings, tmp_path):
    settings.HANGAR_JOB_WORKDIR = tmp_path / "jobs"
    settings.HANGAR_SNAPSHOT_CACHE_DIR = tmp_path / "cache"
    return tmp_path


def test_an_error_in_an_execd_config_is_traced_to_the_file_in_the_jobs_code(node_dirs, project, owner):
    # nanoGPT's way: train.py execs configurator.py, which execs the config named on the command line.
    files = {"train.py": TRAIN, "configurator.py": CONFIGURATOR, "config/small.py": CONFIG}
    snapshot = make_snapshot(project, owner, files, node_dirs / "src")
    make_job(project, owner, command=[sys.executable, "train.py", "config/small.py"], snapshot=snapshot,
             code={"snapshot": snapshot.sha256})  # fmt: skip
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)

    texts = list(LogLine.objects.filter(attempt_id=attempt.pk).values_list("text", flat=True))
    assert 'File "<string>", line 4, in <module>' in "\n".join(texts), texts  # the setup: Python names no file
    found = diagnosing.wait_for(attempt.pk)
    assert found["category"] == "python_exception", found
    assert "NameError: name 'warmup_ratio' is not defined (config/small.py:4 in <module>)" == found["summary"]
    assert "`warmup_iters = warmup_ratio * max_iters`" in found["hint"]


def test_only_the_wanted_files_are_read_from_the_snapshot(db, project, owner, tmp_path):
    files = {"train.py": "x = 1\n", "config/a.py": "lr = 1\n", "big.py": "#" * 300_000}
    snapshot = make_snapshot(project, owner, files, tmp_path)
    job = make_job(project, owner, snapshot=snapshot, code={"snapshot": snapshot.sha256})

    assert diagnosing.job_files(job, ["config/a.py", "big.py", "missing.py"]) == {"config/a.py": "lr = 1\n"}
    assert diagnosing.job_files(make_job(project, owner), ["config/a.py"]) == {}


# A job that prints what made a backtracking engine take seconds a line (tests/test_diagnosis.py).
CRAFTED_JOB = """\
import sys
LINE = 16 * 1024
messages = ["NCCL WARN " * (LINE // 10), "a.so" * (LINE // 4),
            "DataLoader worker (pid 1) is killed by signal: a" + " " * LINE + "x"]
for message in messages * 3:
    for text in ("Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "    step()",
                 "RuntimeError: " + message):
        print(text, file=sys.stderr)
sys.exit(1)
"""


def test_a_jobs_crafted_output_cannot_hold_its_diagnosis(node, project, owner):
    attempt = run(project, owner, CRAFTED_JOB)
    stored = LogLine.objects.filter(attempt=attempt, text__startswith="RuntimeError: NCCL WARN NCCL")
    assert stored.count() == 3 and all(len(t) > 16_000 for t in stored.values_list("text", flat=True))  # the setup

    started = time.monotonic()
    found = diagnosing.store(attempt.pk)

    assert time.monotonic() - started < 2.0
    assert found["category"] == "python_exception" and found["summary"].startswith("RuntimeError: NCCL WARN")


def test_a_crafted_last_line_cannot_hold_the_hang_check(db, project, owner, settings):
    settings.HANGAR_HANG_SECONDS = 600
    attempt = two_rank_attempt(project, owner)
    lines(attempt, 0, ago=1, first_step=200)
    lines(attempt, 1, ago=1, text="step" + " " * 16 * 1024 + "x")  # the scheduler's reconciler reads it

    started = time.monotonic()
    flagged = diagnosing.check_hangs(force=True)

    assert time.monotonic() - started < 1.0
    assert flagged == [] and "straggler" not in Attempt.objects.get(pk=attempt.pk).diagnosis


def test_each_ranks_exit_is_read_from_its_status():
    attempt = Attempt(rank_status={"0": {"exit": 1, "at": 12.5, "stopped": False}, "1": 0, "2": None,
                                   "3": {"exit": 143, "at": 12.9, "stopped": True}})  # fmt: skip

    exits = diagnosing.rank_exits(attempt)

    assert exits == {0: diagnosis.RankExit(1, 12.5, False), 1: diagnosis.RankExit(0),
                     3: diagnosis.RankExit(143, 12.9, True)}  # fmt: skip


def test_a_command_with_a_lone_surrogate_still_gets_its_diagnosis(db, project, owner):
    # JSON allows a lone surrogate in a command; UTF-8, which the recognisers read, has no such character.
    job = make_job(project, owner, command=["python", "train.py", "config/\ud800.py"])
    attempt = make_attempt(job, make_node("node-a"), AttemptState.FAILED, failure_class=FailureClass.USER,
                           exit_code=1, reason="exited with code 1")  # fmt: skip
    texts = ["Traceback (most recent call last):", '  File "<string>", line 1, in <module>', "KeyError: 'lr'"]
    LogLine.objects.bulk_create(
        LogLine(job_id=job.pk, attempt=attempt, node=attempt.node, rank=0, seq=i, rank_seq=i, stream=Stream.STDERR,
                ts=timezone.now(), text=text, severity=40)
        for i, text in enumerate(texts, 1)
    )  # fmt: skip
    assert Job.objects.get(pk=job.pk).command[2] == "config/\ud800.py"  # the setup: it reads back as stored

    found = diagnosing.store(attempt.pk)

    assert found is not None and found["category"] == "python_exception" and "KeyError: 'lr'" in found["summary"]


def test_a_succeeded_attempt_has_none(node, project, owner):
    attempt = run(project, owner, "print('ok')")

    assert attempt.state == AttemptState.SUCCEEDED and attempt.diagnosis == {}


def test_a_timeout_is_diagnosed_as_such(node, project, owner, settings):
    settings.HANGAR_KILL_GRACE_SECONDS = 0.5
    attempt = run(project, owner, "import time\nprint('step', flush=True)\ntime.sleep(30)", max_runtime_seconds=1)

    assert attempt.failure_class == FailureClass.TIMEOUT
    assert diagnosing.wait_for(attempt.pk)["category"] == "timeout"


def test_the_schema_declares_the_diagnosis(db, owner):
    schema = api_client(owner).get("/api/schema/?format=json")
    if schema.status_code == 404:
        schema = api_client(owner).get("/api/v1/schema/?format=json")
    text = schema.content.decode()
    assert "Diagnosis" in text and "first_failing_rank" in text and "hang_suspected" in text


def lines(attempt, rank: int, ago: float, count: int = 1, first_step: int = 0, text: str = "") -> None:
    at = timezone.now() - timedelta(seconds=ago)
    start = LogLine.objects.filter(attempt=attempt).count()
    LogLine.objects.bulk_create(
        LogLine(
            job_id=attempt.job_id,
            attempt=attempt,
            node=attempt.node,
            rank=rank,
            seq=start + i + 1,
            rank_seq=start + i + 1,
            stream=Stream.STDOUT,
            ts=at,
            text=text or f"step {first_step + i}",
        )  # fmt: skip
        for i in range(count)
    )


def two_rank_attempt(project, owner, **fields) -> Attempt:
    other = make_node("node-b", gpus=1)
    job = make_job(project, owner, nodes=2, **fields)
    placement = [{"rank": 0, "node_id": other.pk, "node": "node-b", "gpus": [0]},
                 {"rank": 1, "node_id": other.pk + 0, "node": "node-b", "gpus": [0]}]  # fmt: skip
    started = timezone.now() - timedelta(seconds=120)
    return make_attempt(job, other, AttemptState.RUNNING, placement=placement, started_at=started, running_at=started)


def test_a_rank_silent_while_the_other_prints_is_flagged_once(db, project, owner, settings):
    settings.HANGAR_HANG_SECONDS = 30
    attempt = two_rank_attempt(project, owner)
    lines(attempt, 0, ago=1)
    lines(attempt, 1, ago=100)

    assert diagnosing.check_hangs(force=True) == [attempt.pk]
    assert diagnosing.check_hangs(force=True) == []

    attempt.refresh_from_db()
    assert attempt.diagnosis["hang_suspected"]["ranks"] == [1]
    assert JobEvent.objects.filter(job=attempt.job, kind="hang_suspected").count() == 1
    assert api_client(owner).get(f"/api/v1/jobs/{attempt.job_id}/").json()["hang_suspected"]["ranks"] == [1]
    assert attempt.state == AttemptState.RUNNING  # only flagged: stop_on_hang is off by default
    browser = Client()
    browser.force_login(owner)
    page = browser.get(f"/jobs/{attempt.job_id}/").content.decode()
    assert 'id="job-hang"' in page and "Hang suspected" in page and "rank 1 silent" in page


def test_stop_on_hang_ends_the_attempt_as_the_jobs_failure(db, project, owner, settings):
    settings.HANGAR_HANG_SECONDS = 30
    attempt = two_rank_attempt(project, owner, stop_on_hang=True)
    lines(attempt, 0, ago=1)

    diagnosing.check_hangs(force=True)

    attempt.refresh_from_db()
    assert (attempt.state, attempt.failure_class) == (AttemptState.FAILED, FailureClass.USER)
    assert attempt.reason.startswith("stopped: hang suspected")
    assert attempt.job.__class__.objects.get(pk=attempt.job_id).state == JobState.FAILED
    assert diagnosing.store(attempt.pk)["category"] == "hang"


def test_a_rank_whose_steps_lag_is_flagged_as_a_straggler(db, project, owner, settings):
    settings.HANGAR_HANG_SECONDS = 600  # nobody is silent: a straggler is no hang
    attempt = two_rank_attempt(project, owner)
    lines(attempt, 0, ago=1, first_step=200)
    lines(attempt, 1, ago=1, first_step=120)

    assert diagnosing.check_hangs(force=True) == []

    attempt.refresh_from_db()
    assert attempt.diagnosis["straggler"]["ranks"] == [1] and "hang_suspected" not in attempt.diagnosis
    body = api_client(owner).get(f"/api/v1/jobs/{attempt.job_id}/").json()
    assert body["attempts"][0]["straggler"]["summary"].startswith("straggler: rank 1 at step 120")
    assert JobEvent.objects.filter(job=attempt.job, kind="straggler").count() == 1
