"""A new user's first run, where users are: a clone under /tmp, its .venv made by the
machine's default `python3` (pyenv's, under /root, here), `make start` as root with the
sandbox on; then the jobs a newcomer submits first: a script that decides DDP from `RANK`
as nanoGPT does (one GPU, and two GPUs in one process), and MLflow with no set-up."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.livestack import BASE_DIR, LiveStack

pytestmark = pytest.mark.e2e

DEFAULT_PYTHON = shutil.which("python3")

# What nanoGPT's train.py does first: DDP whenever RANK is set (init_process_group on gloo
# here: no GPU), else one process; then it logs to MLflow as a script does, with no set-up.
TRAIN = textwrap.dedent(
    """
    import os, sys
    print("train.py started", sys.executable, flush=True)
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        import torch.distributed as dist
        dist.init_process_group(backend="nccl")  # nanoGPT's default: fails without GPUs
    print("ddp:", ddp, "devices:", os.environ.get("CUDA_VISIBLE_DEVICES"), flush=True)
    import mlflow
    for step in range(3):
        mlflow.log_metric("loss", 2.0 - step * 0.5, step=step)
    print("logged 3 steps", flush=True)
    """
)


def checkout(top: Path) -> Path:
    """This tree as a clone holds it (tracked and untracked files git does not ignore), with a
    .venv made by the default python3. Its packages are this suite's, hard-linked (pip from the
    index takes minutes here); `.runtime` tells make they are installed."""
    clone = top / "hangar"
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=BASE_DIR,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source, target = BASE_DIR / name.decode(), clone / name.decode()
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    subprocess.run([DEFAULT_PYTHON, "-m", "venv", str(clone / ".venv")], check=True, preexec_fn=lambda: os.umask(0o022))
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    ours = Path(sys.prefix) / "lib" / version / "site-packages"
    theirs = clone / ".venv" / "lib" / version / "site-packages"
    shutil.rmtree(theirs)
    if subprocess.run(["cp", "-al", str(ours), str(theirs)], capture_output=True).returncode != 0:
        shutil.copytree(ours, theirs, symlinks=True)  # another file system: a copy
    (clone / ".venv" / ".runtime").touch()
    return clone


@pytest.fixture(scope="module")
def first_run():
    if os.geteuid() != 0 or not shutil.which("bwrap") or DEFAULT_PYTHON is None:
        pytest.skip("a first run as this machine kind has it: root, bubblewrap, a default python3")
    top = Path(tempfile.mkdtemp(prefix="hangar-first-run-"))
    top.chmod(0o755)
    clone = checkout(top)
    env = {"HANGAR_DATA_DIR": str(clone / "var"), "HANGAR_SANDBOX": "on"}
    try:
        with LiveStack(data_dir=str(clone / "var"), env=env, checkout=clone) as stack:
            yield stack
    finally:
        shutil.rmtree(top, ignore_errors=True)


def lines_of(stack: LiveStack, job_id: int) -> list[str]:
    return [line["text"] for line in stack.api("GET", f"/api/v1/jobs/{job_id}/logs/").json()["lines"]]


def test_the_clones_agent_says_its_jobs_python_runs_as_a_job_uid(first_run):
    said = first_run.output()

    assert "a job's python is Python 3" in said and str(first_run.base_dir / ".venv" / "bin" / "python") in said
    node = first_run.api("GET", "/api/v1/nodes/node-a/").json()
    assert node["isolation"] == "sandbox" and node["job_python_problem"] == "", node


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_script_that_decides_ddp_from_rank_trains_as_one_process_and_logs_to_mlflow(first_run, gpus):
    job = first_run.submit(["python", "-c", TRAIN], gpus_per_node=gpus)
    done = first_run.wait_for(job["id"], ("succeeded", "failed", "cancelled"), timeout=120)
    lines = lines_of(first_run, job["id"])

    assert any(line.startswith("train.py started") for line in lines), (done, lines)  # it ran, in the sandbox
    assert done["state"] == "succeeded", (done, lines)
    assert "ddp: False devices: " + ",".join(str(i) for i in range(gpus)) in lines, lines
    metrics = first_run.api("GET", f"/api/v1/jobs/{job['id']}/metrics/").json()
    assert [value for _, value, _ in metrics["series"]["loss"]] == [2.0, 1.5, 1.0], metrics
