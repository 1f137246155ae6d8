"""Jobs run where users' Pythons are (agent/reach.py, agent/stage.py): an interpreter under
/root (pyenv), a venv in a clone under /tmp, a data directory under a closed directory; a
plain `python`; a PATH without directories the job cannot read; and a program that cannot
start is refused before it starts, as the node's fault where it is the node's."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone

from agent import reach, sandbox
from agent import runner as execution
from fleet.models import GPU
from jobs import scheduler
from jobs.models import AttemptState, FailureClass, LogLine
from tests.factories import make_job, make_node

as_root = pytest.mark.skipif(
    os.getuid() != 0 or not shutil.which("bwrap"), reason="a sandbox needs the agent to run as root, and bubblewrap"
)
PYENV_LIKE = os.path.realpath(sys.base_prefix)  # this machine's Python (pyenv's, under /root, here)


# --- the pure parts ---------------------------------------------------------------------


def test_a_path_is_blocked_at_the_outermost_directory_others_cannot_pass(tmp_path):
    closed = tmp_path / "closed"
    (closed / "open" / "deeper").mkdir(parents=True)
    closed.chmod(0o700)
    (closed / "open").chmod(0o755)
    tmp_path.chmod(0o755)
    try:
        blocked = reach.blocked_at(str(closed / "open" / "deeper" / "python"))
        assert blocked == str(closed) or blocked == reach.blocked_at(str(tmp_path / "x"))
        assert reach.blocked_at("/usr/bin/python3") is None
    finally:
        closed.chmod(0o755)


def test_a_venvs_roots_are_itself_and_the_installation_it_was_made_from(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(f"home = {PYENV_LIKE}/bin\ninclude-system-site-packages = false\n")
    (venv / "bin" / "python").symlink_to(f"{PYENV_LIKE}/bin/python3")

    roots = reach.python_roots(str(venv / "bin" / "python"))

    assert roots[0] == str(venv) and PYENV_LIKE in roots


def test_the_jobs_path_drops_what_its_uid_cannot_read_and_puts_its_python_first(tmp_path):
    venv = tmp_path / "venv"  # bound: seen wherever it is, as its own modes allow
    (venv / "bin").mkdir(parents=True)
    for path in (venv, venv / "bin"):
        path.chmod(0o755)
    view = reach.View(sandboxed=True, hidden=("/var/hangar",), bound=(str(venv),))
    agent_path = "/root/.pyenv/shims:/root/.pyenv/bin:/usr/local/bin:/usr/bin:/tmp/clone/bin:/var/hangar/bin:/bin"

    path = reach.job_path(agent_path, [f"{venv}/bin"], view)

    assert path == f"{venv}/bin:/usr/local/bin:/usr/bin:/bin"
    (venv / "bin").chmod(0o700)  # a venv made with umask 077: its bin/ is out of a job uid's reach
    assert reach.job_path(agent_path, [f"{venv}/bin"], view) == "/usr/local/bin:/usr/bin:/bin"


def test_a_program_out_of_reach_is_the_nodes_fault_and_a_typo_the_users(tmp_path):
    view = reach.View(sandboxed=True)

    pyenv = (
        reach.program_problem(["python", "t.py"], "/usr/bin:/bin", f"{PYENV_LIKE}/bin:/usr/bin", view, "node-a", "/w")
        if PYENV_LIKE.startswith("/root")
        else None
    )
    typo = reach.program_problem(["pythn", "t.py"], "/usr/bin:/bin", "/usr/bin:/bin", view, "node-a", "/w")
    missing = reach.program_problem(["python9.9", "t.py"], "/usr/bin:/bin", "/usr/bin", view, "node-a", "/w")

    if pyenv is not None:
        assert pyenv.nodes_fault and "/root is closed to other users" in pyenv.reason
    assert not typo.nodes_fault and "'pythn' is not found on the job's PATH" in typo.reason
    assert missing.nodes_fault and "HANGAR_JOB_PYTHON" in missing.reason
    assert reach.program_problem(["sh", "-c", "true"], "/usr/bin:/bin", "/bin", view, "node-a", "/w") is None
    # The job's own program (its directory, a relative path) is the job's to start: never judged by root.
    assert reach.program_problem(["./gone.sh"], "/usr/bin", "/usr/bin", view, "node-a", "/w") is None
    assert reach.program_problem(["/w/code/run.sh"], "/usr/bin", "/usr/bin", view, "node-a", "/w") is None


@pytest.mark.parametrize(
    "command, expected",
    [
        (["python", "train.py", "--lr", "1"], ["python", "-m", "torch.distributed.run", "train.py", "--lr", "1"]),
        (["python", "-m", "pkg.train"], ["python", "-m", "torch.distributed.run", "-m", "pkg.train"]),
        (["python", "-c", "print(1)"], ["python", "-m", "torch.distributed.run", "--no-python", "python", "-c"]),
        (["./train.sh"], ["python", "-m", "torch.distributed.run", "--no-python", "./train.sh"]),
    ],
)
def test_torchrun_runs_the_command_from_the_jobs_python(command, expected):
    argv = execution.torchrun_argv(command, 2, 1, 4, "10.0.0.1", "29501")

    options = ["--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--master-addr=10.0.0.1", "--master-port=29501"]
    assert argv[:3] == expected[:3] and argv[3:8] == options
    assert argv[8 : 8 + len(expected) - 3] == expected[3:]


# --- real jobs, real uids, real bubblewrap -------------------------------------------------


@pytest.fixture
def sandboxed(settings):
    settings.HANGAR_SANDBOX = True
    settings.HANGAR_JOB_UID_RANGE = (200000, 299999)
    return settings


def run(project, owner, command, **fields):
    node = make_node("node-a", gpus=2)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())  # preflight's telemetry
    job = make_job(project, owner, command=command, **fields)
    (attempt,) = scheduler.schedule_pass()
    assert attempt.node_id == node.pk
    execution.run_attempt(attempt.pk)
    attempt.refresh_from_db()
    lines = list(LogLine.objects.filter(attempt=attempt).order_by("seq").values_list("text", flat=True))
    return job, attempt, lines


PROBE = textwrap.dedent(
    """
    import os, sys
    print("started", os.getuid(), sys.executable, flush=True)
    print("PATH=" + os.environ["PATH"])
    print("torchrun vars:", sorted(k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR") if k in os.environ))
    """
)


@as_root
def test_a_plain_python_runs_in_the_sandbox_whatever_the_nodes_python_is(transactional_db, project, owner, sandboxed):
    job, attempt, lines = run(project, owner, ["python", "-c", PROBE])

    assert any(line.startswith("started 2") for line in lines), (attempt.reason, lines)  # it ran, as a job uid
    assert attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
    path = next(line for line in lines if line.startswith("PATH="))
    assert path.startswith(f"PATH={Path(sys.executable).parent}:") and "/root/.pyenv/shims" not in path
    assert "torchrun vars: []" in lines  # one process: none of torchrun's variables (nanoGPT would enter DDP)


@as_root
def test_a_venv_under_tmp_and_a_data_directory_under_a_closed_one_are_reached(
    transactional_db, project, owner, sandboxed
):
    # A clone under /tmp with its .venv made from pyenv's Python, and Hangar's data inside a
    # directory only root may pass: a job uid can reach neither without the sandbox's help.
    top = Path(tempfile.mkdtemp(prefix="hangar-clone-"))
    try:
        venv = top / "clone" / ".venv"
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, preexec_fn=lambda: os.umask(0o022)
        )
        closed = top / "closed"
        closed.mkdir(mode=0o700)
        data = closed / "var"
        sandboxed.HANGAR_JOB_PYTHON = str(venv / "bin" / "python")
        sandboxed.HANGAR_JOB_WORKDIR = data / "jobs"
        sandboxed.HANGAR_ENV_CACHE_DIR = data / "envs"
        sandboxed.HANGAR_PIPELINE_ROOT = data / "pipelines"
        assert reach.blocked_at(str(data / "jobs" / "1")) is not None

        job, attempt, lines = run(project, owner, ["python", "-c", PROBE])

        assert any(line.startswith("started 2") and str(venv) in line for line in lines), (attempt.reason, lines)
        assert attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
    finally:
        shutil.rmtree(top, ignore_errors=True)


@as_root
def test_the_start_check_runs_the_nodes_python_as_a_job_uid(transactional_db, sandboxed):
    what, problem = sandbox.python_problem(sys.executable)

    assert problem == "" and what.startswith("Python 3.") and sys.executable in what


@as_root
@pytest.mark.skipif(not PYENV_LIKE.startswith("/root"), reason="needs a Python under /root, as pyenv's")
def test_without_the_sandbox_a_python_under_root_is_refused_as_the_nodes_fault(
    transactional_db, project, owner, sandboxed
):
    sandboxed.HANGAR_SANDBOX = False

    what, problem = sandbox.python_problem(sys.executable)
    job, attempt, lines = run(project, owner, ["python", "-c", PROBE])

    assert "a job's uid cannot run" in problem
    assert attempt.state == AttemptState.FAILED and attempt.failure_class == FailureClass.INFRA
    assert "/root is closed to other users" in attempt.reason and "HANGAR_JOB_PYTHON" in attempt.reason
    assert not any(line.startswith("started") for line in lines)
    assert attempt.diagnosis["category"] == "environment" and "HANGAR_JOB_PYTHON" in attempt.diagnosis["hint"]


@as_root
def test_a_mistyped_program_is_the_users_and_starts_nothing(transactional_db, project, owner, sandboxed):
    job, attempt, lines = run(project, owner, ["pythn", "train.py"])

    assert attempt.state == AttemptState.FAILED and attempt.failure_class == FailureClass.USER
    assert "'pythn' is not found on the job's PATH" in attempt.reason and attempt.exit_code == 127
    assert attempt.diagnosis["category"] == "environment" and "check the command" in attempt.diagnosis["hint"]


@as_root
def test_a_sandbox_that_cannot_be_made_is_the_nodes_fault_not_the_users(transactional_db, project, owner, sandboxed):
    from jobs.models import Environment, EnvironmentKind

    gone = Environment.objects.create(name="gone", kind=EnvironmentKind.HOST, path="/nonexistent/venv", everywhere=True)

    job, attempt, lines = run(project, owner, ["python", "-c", "print('started')"], environment=gone)

    assert "started" not in lines
    assert attempt.state == AttemptState.FAILED and attempt.failure_class == FailureClass.INFRA, attempt.reason
    assert attempt.reason.startswith("could not start the job: the sandbox failed: bwrap: ")
    assert "/nonexistent/venv" in attempt.reason
    assert attempt.diagnosis["category"] == "environment", attempt.diagnosis


@as_root
def test_a_checkpoint_directory_swapped_for_a_link_gives_root_nothing_to_chown(
    transactional_db, project, owner, sandboxed, tmp_path
):
    # The attack: the job's first attempt replaces its checkpoint directory with a link to a
    # root-owned tree and fails; before the retry, root made the checkpoint directory the job's
    # uid's again, following the link: every file of that tree became the job's.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "shadow").write_text("root's\n")
    (victim / "shadow").chmod(0o600)
    script = f"""
        echo attempt "$HANGAR_ATTEMPT" as $(id -u)
        if [ "$HANGAR_ATTEMPT" = 1 ]; then
            rm -rf "$HANGAR_CHECKPOINT_DIR" && ln -s {victim} "$HANGAR_CHECKPOINT_DIR" && echo planted
            exit 1
        fi
        cat {victim}/shadow 2>/dev/null || echo cannot-read
    """
    node = make_node("node-a", gpus=2)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    job = make_job(project, owner, command=["/bin/sh", "-c", textwrap.dedent(script)], max_retries=1)
    seen = []
    for _ in range(2):
        (attempt,) = scheduler.schedule_pass()
        execution.run_attempt(attempt.pk)
        seen += list(LogLine.objects.filter(attempt=attempt).order_by("seq").values_list("text", flat=True))

    assert "planted" in seen and any(line.startswith("attempt 2 as 2") for line in seen), seen
    info = (victim / "shadow").stat()
    assert (info.st_uid, info.st_mode & 0o777, victim.stat().st_uid) == (0, 0o600, 0)
    assert "cannot-read" in seen and "root's" not in seen
    assert not job.checkpoint_dir().is_symlink() and job.checkpoint_dir().is_dir()  # made anew, the job's


@as_root
def test_a_staged_directory_removed_and_made_anew_is_staged_again(tmp_path):
    from agent.stage import Stage

    stage = Stage()  # a namespace of its own, beside this process's
    root = tmp_path / "jobs"
    root.mkdir()
    (root / "old").write_text("1")
    try:
        first = stage.source(str(root))
        shutil.rmtree(root)
        root.mkdir()
        (root / "new").write_text("2")
        second = stage.source(str(root))

        seen = os.listdir(f"/proc/{stage.holder.pid}/root{second}")
        assert first != second and seen == ["new"]
        assert stage.enter_argv()[1] == f"--mount=/proc/{stage.holder.pid}/ns/mnt"
        assert not os.listdir(stage.stage_dir)  # the host's mount table never changed
    finally:
        stage.holder.kill()


@as_root
def test_an_environment_a_job_uid_cannot_run_is_not_offered_and_the_queue_says_why(
    transactional_db, project, owner, sandboxed, tmp_path
):
    from jobs.models import Environment, EnvironmentKind
    from jobs.scheduler import queue_report

    closed = tmp_path / "venv"  # made by root with umask 077: its bin/ is root's alone
    (closed / "bin").mkdir(parents=True)
    (closed / "bin" / "python").symlink_to(sys.executable)
    for path in (tmp_path, closed):
        path.chmod(0o755)
    Environment.objects.create(name="closed", kind=EnvironmentKind.HOST, path=str(closed))
    Environment.objects.create(name="fine", kind=EnvironmentKind.HOST, path=str(Path(sys.executable).parent.parent))

    refused = sandbox.unrunnable_environments(["closed", "fine"])

    assert list(refused) == ["closed"] and "a job's uid cannot run" in refused["closed"]
    node = make_node("node-a", gpus=2, refused_environments=refused)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    job = make_job(project, owner, environment=Environment.objects.get(name="closed"))
    rows, _ = queue_report()
    reason = next(row["reason"] for row in rows if row["job_id"] == job.pk)
    assert reason["code"] == "environment" and "refused by node-a: a job's uid cannot run" in reason["message"]
    page = Client()
    page.force_login(owner)
    assert "environment closed not offered" in page.get(f"/fleet/nodes/{node.name}/").content.decode()


@as_root
@pytest.mark.parametrize("mode, started", [(0o755, True), (0o644, False)])
def test_a_jobs_own_script_starts_or_fails_as_the_jobs_own(transactional_db, project, owner, sandboxed, mode, started):
    job = make_job(project, owner, command=["./run.sh"])
    workdir = sandboxed.HANGAR_JOB_WORKDIR / str(job.pk)
    workdir.mkdir(parents=True)
    (workdir / "run.sh").write_text("#!/bin/sh\necho own script ran\n")
    (workdir / "run.sh").chmod(mode)
    node = make_node("node-a", gpus=2)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())

    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)
    attempt.refresh_from_db()
    lines = list(LogLine.objects.filter(attempt=attempt).order_by("seq").values_list("text", flat=True))

    if started:
        assert "own script ran" in lines and attempt.state == AttemptState.SUCCEEDED, (attempt.reason, lines)
    else:  # its own file without the execute bit: the user's to fix, never a requeue as the node's
        assert attempt.state == AttemptState.FAILED and attempt.failure_class == FailureClass.USER, attempt.reason


@as_root
def test_a_folder_swapped_for_a_link_to_a_fifo_never_holds_root_giving_a_tree_away(tmp_path):
    # The attack: while root walks a job's tree to chown it, the job swaps a listed folder for a
    # link to a FIFO. os.fwalk opened the name as listed (no O_NOFOLLOW): root blocked for ever.
    top = tmp_path / "job"
    top.mkdir()
    os.mkfifo(top / "fifo")
    swapper = subprocess.Popen(
        [sys.executable, "-c", SWAP, str(top)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert swapper.stdout.readline().strip() == b"swapping"  # the race runs
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        done = threading.Event()

        def give_again_and_again():
            for _ in range(300):
                os.fchown(fd, 0, 0)  # root's again: the next call walks it all
                sandbox.give_tree(fd, 200777, 200777)
            done.set()

        threading.Thread(target=give_again_and_again, daemon=True).start()
        assert done.wait(60), "the walk blocked on a FIFO a link in a folder's place pointed at"
        os.close(fd)
    finally:
        swapper.kill()
        swapper.wait()


SWAP = """
import os, sys
os.chdir(sys.argv[1])
names = [f"d{i}" for i in range(64)]  # many folders: the walk opens each a while after listing it
for name in names:
    os.mkdir(name)
print("swapping", flush=True)
while True:
    for name in names:
        os.rmdir(name); os.symlink("fifo", name); os.unlink(name); os.mkdir(name)
"""


@as_root
def test_removing_a_jobs_tree_removes_its_links_and_never_what_they_point_at(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("root's")
    tree = tmp_path / "copy"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "file").write_text("x")
    os.symlink(outside, tree / "a" / "link-to-dir")
    os.symlink(outside / "keep", tree / "link-to-file")
    os.mkfifo(tree / "fifo")

    sandbox.remove_path(tree)
    sandbox.remove_path(tree)  # gone: nothing to do

    assert not tree.exists() and (outside / "keep").read_text() == "root's"
