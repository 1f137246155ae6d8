"""Pipeline reruns never make root copy, chmod or follow what a job wrote (issue 52).

A run is run again only once every stage of it ended (409 before), and the rerun's directory
is copied from the earlier run's by its first stage's attempt, on its node, as that stage's
uid (agent/pipelinecopy.py): driven here as the runner drives it. Each test performs the
attack: a real job uid flipping a file between a regular file and a link to a root-only file
while reruns are asked and copies made; a set-uid copy of /usr/bin/id; a 2 GiB sparse file and
the quota; a copy that fails half-way (a full disk) or is stopped; a run's directory a job uid
swapped for a link in a pipeline root it can write."""

import os
import secrets
import shutil
import stat
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import pytest
from django.utils import timezone

from agent import pipelinecopy, sandbox
from agent import runner as execution
from agent.environments import uid_user
from fleet.models import GPU
from jobs import pipelines
from jobs.models import AttemptState, FailureClass, PipelineRun
from jobs.models.pipeline import CopyState, PipelineUid
from tests.factories import api_client, make_attempt, make_node
from tests.test_sandbox import as_root, lines_of, place, uid_printed

URL = "/api/v1/pipelines/"
RANGE = (200000, 299999)
GiB = 1024**3
MiB = 1024**2
PYTHON = "/usr/bin/python3"  # the system's: every job uid can run it, in a sandbox too
root_only = pytest.mark.skipif(os.getuid() != 0, reason="real job uids need the tests to run as root")

# Swaps `data` between a regular file and a link to the secret, each by an atomic rename, for
# argv[1] seconds; prints its uid, then a marker before and after.
FLIPPER = textwrap.dedent(
    """
    import os, sys, time
    os.umask(0o022)
    os.chdir(os.environ.get("HANGAR_PIPELINE_DIR", "."))
    print(os.getuid())
    print("flipping", flush=True)
    end, flips = time.monotonic() + float(sys.argv[2]), 0
    while time.monotonic() < end:
        with open("data.new", "w") as f:
            f.write("public\\n")
        os.rename("data.new", "data")
        os.symlink(sys.argv[1], "data.link")
        os.rename("data.link", "data")
        flips += 1
    print("flipped", flips, flush=True)
    """
)


@pytest.fixture
def roots(settings):
    """The pipeline root, in the data directory (the agent's own, writable by no one else); as
    root, stages have uids of their own."""
    settings.HANGAR_PIPELINE_ROOT = settings.DATA_DIR / f"pipelines-{secrets.token_hex(4)}"
    settings.HANGAR_JOB_UID_RANGE = RANGE if os.getuid() == 0 else None
    yield settings.HANGAR_PIPELINE_ROOT
    shutil.rmtree(settings.HANGAR_PIPELINE_ROOT, ignore_errors=True)


class Log:
    """What the stage's log is told (the runner's `system`)."""

    def __init__(self):
        self.lines: list[tuple[str, bool]] = []

    def __call__(self, text: str, error: bool = False) -> None:
        self.lines.append((text, error))

    def text(self) -> str:
        return "\n".join(line for line, _ in self.lines)


def finished_run(owner, node, stages: dict | None = None) -> PipelineRun:
    """A run whose every stage succeeded (its directory made by the web process, still empty)."""
    stages = stages or {"train": {"command": ["true"]}}
    run = pipelines.submit_pipeline(owner, {"project": "vision", "name": "p", "stages": stages}).run
    for stage in run.ordered_stages():
        make_attempt(stage.job, node, AttemptState.RUNNING).finish(AttemptState.SUCCEEDED, "", "done")
    return run


def first_stage(run: PipelineRun):
    return next(stage.job for stage in run.ordered_stages() if not stage.reused)


def stage_user(job):
    """The uid the runner would give this stage's job here (None: the node isolates nothing)."""
    if os.getuid() != 0:
        return None
    return uid_user(sandbox.job_uid(job.pk, RANGE, sandbox.uids_in_use()))


def prepare(run: PipelineRun, log: Log, **kwargs):
    """What the runner does before the stage's command: the hook, as the stage's uid."""
    job = first_stage(run)
    user = stage_user(job)
    pipelinecopy.prepare_stage_directory(job, user, user is not None, log, **kwargs)
    return user


def owned_as(path: Path, uid: int, mode: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    if not path.is_symlink():
        path.chmod(mode)  # after the chown, which drops set-id bits


def leftovers(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith(".copy-"))


def regular_files(top: Path) -> list[Path]:
    return [p for p in top.rglob("*") if not p.is_symlink() and p.is_file()]


def refused_while_running(client, run: PipelineRun, job) -> bool:
    """Ask for a rerun: refused naming the stage while its job has not ended (True); accepted
    only once it has (False: the runner's thread may still be closing its log)."""
    response = client.post(f"{URL}{run.pk}/rerun/", {"from_stage": "flip"}, format="json")
    if response.status_code != 409:
        job.refresh_from_db()
        assert response.status_code == 201 and job.is_final, (response.content, job.state)
        return False
    errors = {e["field"]: e["message"] for e in response.json()["errors"]}
    assert f"stage flip (job {job.pk}) is " in errors["stages.flip"], errors
    return True


# --- the race: a link to a root-only file, flipped by a real job uid -----------------------


@as_root
@pytest.mark.skipif(not os.access(PYTHON, os.X_OK), reason=f"{PYTHON} runs the flipping stage")
def test_a_stage_flipping_a_link_to_a_root_only_file_gets_no_rerun_while_it_runs_and_no_copy_of_it(
    transactional_db, project, owner, settings, roots
):
    settings.HANGAR_SANDBOX, settings.HANGAR_JOB_UID_RANGE = True, RANGE
    secret = settings.DATA_DIR / "secret-stand-in"  # what $HANGAR_DATA_DIR/secret_key is to root
    secret.write_bytes(b"SECRET-" + secrets.token_hex(24).encode())
    secret.chmod(0o600)
    GPU.objects.filter(node=make_node("node-a", gpus=2)).update(temperature_c=35, sampled_at=timezone.now())
    stages = {"flip": {"command": [PYTHON, "-c", FLIPPER, str(secret), "4"]}}
    run = pipelines.submit_pipeline(owner, {"project": "vision", "name": "flip", "stages": stages}).run
    attempt = place(first_stage(run))
    stage = threading.Thread(target=execution.run_attempt, args=(attempt.pk,), daemon=True)
    stage.start()
    client = api_client(owner)
    deadline = time.monotonic() + 60
    while "flipping" not in lines_of(attempt) and stage.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = 0
    while stage.is_alive() and time.monotonic() < deadline:  # reruns asked while it flips
        if not refused_while_running(client, run, attempt.job):
            break
        refused += 1
        time.sleep(0.1)
    stage.join(timeout=30)
    attempt.refresh_from_db()
    lines = lines_of(attempt)
    assert attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
    assert "flipping" in lines and any(line.startswith("flipped") for line in lines) and refused >= 1, lines
    flipped_as = uid_printed(lines)
    run.record_uid(flipped_as)  # as prepare_stage_directory records it when a stage starts

    # A process of that uid left behind (no sandbox keeps it from outliving its stage) flips on
    # while the reruns' first stages copy the directory, each as its own uid.
    flipper = subprocess.Popen(
        ["setpriv", f"--reuid={flipped_as}", f"--regid={flipped_as}", "--clear-groups", "--", PYTHON, "-c"]
        + [FLIPPER, str(secret), "60"],
        cwd=run.directory,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flipper.stdout.readline().strip() == str(flipped_as) and flipper.stdout.readline() == "flipping\n"
        for _ in range(6):
            response = client.post(f"{URL}{run.pk}/rerun/", {"from_stage": "flip"}, format="json")
            assert response.status_code == 201, response.content
            again = PipelineRun.objects.get(pk=response.json()["id"])
            log = Log()
            user = prepare(again, log)
            copy = Path(again.directory)
            for path in regular_files(copy):
                assert secret.read_bytes() not in path.read_bytes(), (path, log.lines)
                assert path.stat().st_uid == user.uid
            data = copy / "data"
            if data.is_symlink():
                assert os.readlink(data) == str(secret)  # copied as the link it was, never followed
            assert f"as uid {user.uid}" in log.text()
        assert flipper.poll() is None, "the flipper ended before the copies did"
    finally:
        flipper.kill()
        flipper.wait()
    assert secret.stat().st_mode & 0o777 == 0o600 and secret.stat().st_uid == 0  # root shared nothing outside


# --- set-id bits, ownership, what the earlier stages owned ---------------------------------


@root_only
def test_a_set_uid_program_in_the_earlier_run_comes_back_without_set_id_bits_as_the_stages_uid(
    db, owner, project, node, settings, roots
):
    earlier = finished_run(owner, node)
    before = sandbox.job_uid(first_stage(earlier).pk, RANGE, set())  # the earlier stage's uid
    directory = Path(earlier.directory)
    shutil.copy("/usr/bin/id", directory / "id")
    owned_as(directory / "id", before, 0o4755)
    (directory / "group-id").write_bytes(b"#!/bin/sh\n")
    owned_as(directory / "group-id", before, 0o2750)
    (directory / "sub").mkdir()
    (directory / "sub" / "weights").write_bytes(b"w" * 10_000)
    owned_as(directory / "sub" / "weights", before, 0o600)  # only its own uid reads it
    owned_as(directory / "sub", before, 0o700)
    (directory / "latest").symlink_to("sub/weights")
    owned_as(directory / "latest", before, 0)
    root_only_file = settings.DATA_DIR / "root-only"
    root_only_file.write_bytes(b"root's")
    root_only_file.chmod(0o600)
    os.link(root_only_file, directory / "linked")  # a kernel without protected_hardlinks allows a stage this
    assert (directory / "id").stat().st_mode & stat.S_ISUID

    again = pipelines.rerun(owner, earlier, "train").run
    assert not Path(again.directory).exists()  # the web process copies nothing
    log = Log()
    user = prepare(again, log)

    copy = Path(again.directory)
    for name in ("id", "group-id"):
        info = (copy / name).stat()
        assert info.st_uid == user.uid and not info.st_mode & (stat.S_ISUID | stat.S_ISGID), (name, oct(info.st_mode))
    assert (copy / "id").stat().st_mode & 0o111 == 0o111  # still a program, shared with the run's next stages
    weights = copy / "sub" / "weights"
    assert weights.read_bytes() == b"w" * 10_000 and weights.stat().st_uid == user.uid
    assert os.readlink(copy / "latest") == "sub/weights"  # a link copied as a link
    assert not (copy / "linked").exists() and "linked (this uid cannot read it)" in log.text()
    assert root_only_file.stat().st_mode & 0o777 == 0o600  # root chmodded nothing that is not the run's
    assert PipelineUid.objects.filter(run=again, uid=user.uid).exists()
    again.refresh_from_db()
    assert again.copy_state == CopyState.DONE and "linked" in again.copy_reason
    assert again.copy_bytes == sum(p.stat().st_size for p in regular_files(copy)) == again.copy_total - len(b"root's")
    assert leftovers(roots) == []


# --- sparse files and the quota --------------------------------------------------------------


def test_a_sparse_file_stays_sparse_and_a_run_over_the_quota_is_refused_leaving_nothing(
    db, owner, project, node, settings, roots, client
):
    settings.HANGAR_PIPELINE_MAX_BYTES = MiB
    earlier = finished_run(owner, node)
    sparse = Path(earlier.directory) / "sparse.bin"
    with open(sparse, "wb") as f:
        for offset, data in ((0, b"head"), (GiB, b"middle"), (2 * GiB - 4, b"tail")):
            f.seek(offset)
            f.write(data)
    if os.getuid() == 0:
        owned_as(sparse, sandbox.job_uid(first_stage(earlier).pk, RANGE, set()), 0o644)
    again = pipelines.rerun(owner, earlier, "train").run
    client.force_login(owner)
    assert "Waiting for its first stage" in client.get(f"/pipelines/{again.pk}/").content.decode()

    prepare(again, Log())
    copied = Path(again.directory) / "sparse.bin"
    info = copied.stat()
    assert info.st_size == 2 * GiB and info.st_blocks * 512 <= MiB, (info.st_size, info.st_blocks)
    with open(copied, "rb") as f:
        assert [(f.seek(o), f.read(n))[1] for o, n in ((0, 4), (GiB, 6), (2 * GiB - 4, 4))] == [
            b"head",
            b"middle",
            b"tail",
        ]
    page = client.get(f"/pipelines/{again.pk}/").content.decode()
    assert 'id="pipeline-copy"' in page and "Copied" in page and "<progress" in page

    (Path(earlier.directory) / "dense.bin").write_bytes(os.urandom(2 * MiB))
    over = pipelines.rerun(owner, earlier, "train").run
    log = Log()
    with pytest.raises(pipelinecopy.CopyRefused) as refused:
        prepare(over, log)
    reason = refused.value.reason
    assert refused.value.failure_class == FailureClass.USER
    assert "over HANGAR_PIPELINE_MAX_BYTES (1.0 MiB)" in reason and "the user's to change" in reason
    assert (reason, True) in log.lines  # said in the stage's log
    assert not os.path.lexists(over.directory) and leftovers(roots) == []
    body = api_client(owner).get(f"{URL}{over.pk}/").json()
    assert body["copy"]["state"] == "failed" and body["copy"]["reason"] == reason


def test_the_copys_progress_reaches_the_run_as_it_goes(db, owner, project, node, roots, monkeypatch):
    earlier = finished_run(owner, node)
    for index in range(3):
        path = Path(earlier.directory) / f"shard-{index}"
        path.write_bytes(os.urandom(256 * 1024))
        if os.getuid() == 0:  # as the earlier stage's uid wrote it
            owned_as(path, sandbox.job_uid(first_stage(earlier).pk, RANGE, set()), 0o600)
    monkeypatch.setattr(pipelinecopy, "PROGRESS_SECONDS", 0)  # a report for each file copied
    written = []
    progressed = PipelineRun.copy_progressed
    monkeypatch.setattr(PipelineRun, "copy_progressed", lambda run, n: (written.append(n), progressed(run, n)))
    again = pipelines.rerun(owner, earlier, "train").run

    prepare(again, Log())

    again.refresh_from_db()
    assert written == [256 * 1024, 512 * 1024, 768 * 1024], written  # one write a report, none for the end
    assert again.copy_state == CopyState.DONE and again.copy_bytes == again.copy_total == 768 * 1024


def test_the_quota_holds_while_copying_when_a_file_grew_after_the_first_scan(tmp_path):
    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    for name in ("a", "b"):
        (source / name).write_bytes(os.urandom(600 * 1024))
    read, write = os.pipe()
    fds = [os.open(path, pipelinecopy.DIRECTORY) for path in (source, target)]
    try:
        budget = pipelinecopy.Budget(MiB, write, "pipeline run 1")
        with pytest.raises(pipelinecopy.Refused, match="over HANGAR_PIPELINE_MAX_BYTES"):
            pipelinecopy.copy_tree(*fds, budget, "")
        assert budget.copied <= MiB
    finally:
        for fd in (*fds, read, write):
            os.close(fd)


# --- a copy that fails or stops half-way leaves nothing -------------------------------------


@pytest.fixture
def small_root(tmp_path):
    """A 1 MiB filesystem for the pipeline root: a copy runs out of space half-way."""
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0711", "tmpfs", small]).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    yield small
    subprocess.run(["umount", small], check=True)


@root_only
def test_a_copy_that_fails_half_way_leaves_no_directory(db, owner, project, node, settings, roots, small_root):
    earlier = finished_run(owner, node)  # its directory on the data directory's filesystem
    before = sandbox.job_uid(first_stage(earlier).pk, RANGE, set())
    for index in range(4):
        path = Path(earlier.directory) / f"shard-{index}"
        path.write_bytes(os.urandom(512 * 1024))
        owned_as(path, before, 0o600)
    settings.HANGAR_PIPELINE_ROOT = small_root
    again = pipelines.rerun(owner, earlier, "train").run
    log = Log()

    with pytest.raises(pipelinecopy.CopyRefused) as refused:
        prepare(again, log)

    assert refused.value.failure_class == FailureClass.INFRA and "No space left on device" in refused.value.reason
    assert os.listdir(small_root) == []  # neither the run's directory nor a partial one
    again.refresh_from_db()
    assert again.copy_state == CopyState.FAILED and 0 < again.copy_bytes < 2 * MiB, again.copy_bytes
    assert (refused.value.reason, True) in log.lines


def test_a_copy_stopped_by_the_attempts_end_leaves_no_directory(db, owner, project, node, roots, monkeypatch):
    earlier = finished_run(owner, node)
    for index in range(20):
        path = Path(earlier.directory) / f"shard-{index}"
        path.write_bytes(os.urandom(256 * 1024))
    again = pipelines.rerun(owner, earlier, "train").run
    monkeypatch.setattr(pipelinecopy, "CHECK_SECONDS", 0)  # the attempt's end is seen at the first look

    with pytest.raises(pipelinecopy.CopyStopped):
        prepare(again, Log(), still_current=lambda: False)

    assert not os.path.lexists(again.directory) and leftovers(roots) == []
    again.refresh_from_db()
    assert again.copy_state == CopyState.FAILED and "nothing was kept" in again.copy_reason


def test_a_rerun_of_a_run_whose_directory_is_gone_starts_empty_and_says_so(db, owner, project, node, roots):
    earlier = finished_run(owner, node)
    shutil.rmtree(earlier.directory)
    again = pipelines.rerun(owner, earlier, "train").run
    log = Log()

    prepare(again, log)

    assert os.listdir(again.directory) == [] and "starts with an empty one" in log.text()
    again.refresh_from_db()
    assert again.copy_state == CopyState.DONE


def test_a_whole_rerun_copies_nothing_and_a_stage_of_no_pipeline_is_left_alone(db, owner, project, node, roots):
    from tests.factories import make_job

    earlier = finished_run(owner, node)
    (Path(earlier.directory) / "kept").write_text("x")
    again = pipelines.rerun(owner, earlier).run
    assert again.copy_state == "" and os.listdir(again.directory) == []
    prepare(again, Log())
    assert os.listdir(again.directory) == []
    pipelinecopy.prepare_stage_directory(make_job(project, owner), None, False, Log())  # no stage: nothing


def test_a_pipeline_root_others_can_write_fails_the_stage_as_infra_saying_what_to_fix(db, owner, project, node, roots):
    earlier = finished_run(owner, node)
    again = pipelines.rerun(owner, earlier, "train").run
    roots.chmod(0o777)  # any uid could then swap a run's directory for a link
    log = Log()

    with pytest.raises(pipelinecopy.CopyRefused) as refused:
        prepare(again, log)

    assert refused.value.failure_class == FailureClass.INFRA and "chmod go-w" in refused.value.reason
    assert not os.path.lexists(again.directory) and (refused.value.reason, True) in log.lines


@root_only
@pytest.mark.skipif(not os.access(PYTHON, os.X_OK), reason=f"{PYTHON} swaps the directory as a job uid")
def test_a_run_directory_a_job_uid_swapped_for_a_link_opens_nothing_it_points_at(
    db, owner, project, node, settings, roots
):
    run = pipelines.submit_pipeline(owner, {"project": "vision", "stages": {"train": {"command": ["true"]}}}).run
    closed = settings.DATA_DIR / f"closed-{secrets.token_hex(4)}"
    closed.mkdir(mode=0o700)
    roots.chmod(0o777)  # a pipeline root any uid can write (an operator's shared folder)
    uid = stage_user(first_stage(run)).uid
    name = Path(run.directory).name
    swap = f"import os; os.rename({name!r}, 'gone'); os.symlink({str(closed)!r}, {name!r}); print('swapped')"
    done = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", PYTHON, "-c", swap],
        cwd=roots,  # entered as root: the uid needs no way into the data directory
        capture_output=True,
        text=True,
    )
    assert done.stdout == "swapped\n" and os.readlink(run.directory) == str(closed), done.stderr  # the setup
    log = Log()

    with pytest.raises(pipelinecopy.CopyRefused) as refused:
        prepare(run, log)  # the next stage's start, sharing the run's directory with its uid

    assert refused.value.failure_class == FailureClass.INFRA and "chmod go-w" in refused.value.reason
    assert stat.S_IMODE(closed.stat().st_mode) == 0o700  # not made 0777 through the link


def test_a_rerun_starting_empty_keeps_the_directory_another_rank_made_first(db, owner, project, node, roots):
    earlier = finished_run(owner, node)
    shutil.rmtree(earlier.directory)
    again = pipelines.rerun(owner, earlier, "train").run
    os.mkdir(again.directory)  # another rank's, made between this one's look and its own mkdir
    (Path(again.directory) / "written").write_text("by that rank's stage")

    pipelinecopy.copy_earlier(again, stage_user(first_stage(again)), Log(), None)

    assert (Path(again.directory) / "written").read_text() == "by that rank's stage"


def test_the_run_pages_run_again_says_which_stage_is_still_going(db, owner, project, node, roots, client):
    run = pipelines.submit_pipeline(owner, {"project": "vision", "stages": {"train": {"command": ["true"]}}}).run
    client.force_login(owner)

    response = client.post(f"/pipelines/{run.pk}/rerun/", {"from_stage": "train"}, follow=True)

    page = response.content.decode()
    assert f"stage train (job {first_stage(run).pk}) is queued" in page and PipelineRun.objects.count() == 1


def test_a_tree_deeper_than_a_rerun_copies_is_refused_as_the_users_leaving_nothing(db, owner, project, node, roots):
    earlier = finished_run(owner, node)
    deep = Path(earlier.directory)
    for _ in range(pipelinecopy.MAX_DEPTH + 2):
        deep = deep / "d"
        deep.mkdir()
        if os.getuid() == 0:  # as the earlier stage's uid made them
            owned_as(deep, sandbox.job_uid(first_stage(earlier).pk, RANGE, set()), 0o700)
    again = pipelines.rerun(owner, earlier, "train").run

    with pytest.raises(pipelinecopy.CopyRefused) as refused:
        prepare(again, Log())

    assert refused.value.failure_class == FailureClass.USER and "folders deep" in refused.value.reason
    assert not os.path.lexists(again.directory) and leftovers(roots) == []


def test_without_isolation_the_copy_runs_as_the_agents_own_user(db, owner, project, node, roots):
    earlier = finished_run(owner, node)
    (Path(earlier.directory) / "model.ckpt").write_bytes(b"weights")
    again = pipelines.rerun(owner, earlier, "train").run
    log = Log()

    pipelinecopy.prepare_stage_directory(first_stage(again), None, False, log)  # jobs run as the agent's user

    copied = Path(again.directory) / "model.ckpt"
    assert copied.read_bytes() == b"weights" and copied.stat().st_uid == os.geteuid()
    assert "as the agent's user" in log.text()
