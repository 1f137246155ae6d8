"""Code snapshots end to end: the real `hangar` CLI process against a live stack. A job
submitted with --code runs its own copy of the directory (it prints its file's hash), an
unchanged tree uploads nothing the second time, resubmit reuses the snapshot, a changed
tree runs the changed code, and `hangar code` brings back what was packed. A nanoGPT-like
tree's gitignored data rides along with `.hangarinclude`, and the CLI says what it left
out; a header bomb PUT to the live web server is refused without its memory growing."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from hangar.snapshots import pack
from tests.livestack import BASE_DIR, LiveStack
from tests.test_snapshots_tarballs import header_bomb

pytestmark = pytest.mark.e2e
PY = sys.executable

TRAIN = textwrap.dedent(
    """
    import hashlib, pathlib
    print("my hash", hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest(), flush=True)
    print("lr", pathlib.Path("config/lr.txt").read_text().strip(), flush=True)
    """
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with LiveStack(data_dir=str(tmp_path_factory.mktemp("snapshot-stack"))) as live:
        yield live


@pytest.fixture
def hangar(stack, tmp_path):
    """`hangar ARGS...` as its own process; (exit code, stdout, stderr)."""
    env = {
        "HANGAR_URL": stack.url,
        "HANGAR_TOKEN": stack.token,
        "HANGAR_CONFIG": str(tmp_path / "config.json"),
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
    }

    def run(*args: str) -> tuple[int, str, str]:
        done = subprocess.run(
            [PY, "-m", "hangar.cli", *args], capture_output=True, text=True, env=env, timeout=120, cwd=BASE_DIR
        )
        return done.returncode, done.stdout, done.stderr

    return run


def git(root: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@x"
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture
def work_tree(tmp_path) -> Path:
    root = tmp_path / "exp"
    (root / "config").mkdir(parents=True)
    (root / "train.py").write_text(TRAIN)
    (root / "config" / "lr.txt").write_text("0.1\n")
    (root / ".gitignore").write_text("checkpoints/\n")
    (root / "checkpoints").mkdir()
    (root / "checkpoints" / "big.pt").write_bytes(b"\0" * 1024)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", ".")
    git(root, "commit", "-qm", "start")
    return root


def submit_code(hangar, root: Path) -> tuple[dict, str]:
    code, out, err = hangar("--json", "submit", "-p", "default", "--code", str(root), "--wait", "--", PY, "train.py")
    assert code == 0, err + out
    return json.loads(out), err


def printed(hangar, job_id: int) -> list[str]:
    code, out, err = hangar("--json", "logs", str(job_id))
    assert code == 0, err
    return [json.loads(line)["text"] for line in out.splitlines()]


def test_a_job_runs_its_own_snapshot_and_an_unchanged_tree_uploads_nothing(hangar, work_tree, tmp_path):
    own = hashlib.sha256(TRAIN.encode()).hexdigest()
    job, err = submit_code(hangar, work_tree)
    assert job["state"] == "succeeded" and "uploaded" in err and "nothing uploaded" not in err
    assert job["code"]["snapshot"] == pack(work_tree).sha256
    assert job["code"]["commit"] == git(work_tree, "rev-parse", "HEAD").strip() and job["code"]["dirty"] is False
    assert f"my hash {own}" in printed(hangar, job["id"]) and "lr 0.1" in printed(hangar, job["id"])

    again, err = submit_code(hangar, work_tree)
    assert "unchanged, nothing uploaded" in err
    assert again["code"]["snapshot"] == job["code"]["snapshot"]

    code, out, err = hangar("--json", "resubmit", str(job["id"]))
    assert code == 0, err
    rerun = json.loads(out)
    code, out, err = hangar("--json", "wait", str(rerun["id"]), "--timeout", "60")
    assert code == 0, err
    assert json.loads(out)["code"]["snapshot"] == job["code"]["snapshot"]
    assert f"my hash {own}" in printed(hangar, rerun["id"])

    code, _, err = hangar("code", str(job["id"]), "-o", str(tmp_path / "back"))
    assert code == 0, err
    assert (tmp_path / "back" / "train.py").read_text() == TRAIN
    assert not (tmp_path / "back" / "checkpoints").exists()  # .gitignore'd: never packed


def test_a_changed_tree_runs_its_own_code_with_its_diff_recorded(hangar, work_tree):
    first, _ = submit_code(hangar, work_tree)
    (work_tree / "config" / "lr.txt").write_text("0.3\n")
    changed, err = submit_code(hangar, work_tree)
    assert "uploaded" in err and "nothing uploaded" not in err
    assert changed["code"]["snapshot"] != first["code"]["snapshot"] and changed["code"]["dirty"] is True
    assert "lr 0.3" in printed(hangar, changed["id"]) and "lr 0.1" in printed(hangar, first["id"])
    code, out, _ = hangar("status", str(changed["id"]))
    assert code == 0 and f"snapshot {changed['code']['snapshot'][:12]} (git main @ " in out and "dirty" in out


def test_bad_code_directories_are_refused_before_anything_is_sent(hangar, work_tree, tmp_path):
    (work_tree / "outside").symlink_to(tmp_path)
    code, _, err = hangar("submit", "-p", "default", "--code", str(work_tree), "--", PY, "train.py")
    assert code == 2 and "symlinks point outside the directory" in err and "outside ->" in err
    (work_tree / "outside").unlink()
    (work_tree / "weights.bin").write_bytes(os.urandom(300 * 1024))
    code, _, err = hangar("submit", "-p", "default", "--code", str(work_tree), "--code-limit", "0.2", "--", "true")
    assert code == 2 and "over the 0.2 MB limit; the biggest: weights.bin (0.3 MB)" in err
    code, out, _ = hangar("--json", "list")
    assert all(j["command"] != ["true"] for j in json.loads(out))  # nothing half-created


READ_DATA = textwrap.dedent(
    """
    import hashlib, pathlib
    data = pathlib.Path("data/shakespeare_char/input.txt").read_bytes()
    print("input.txt", hashlib.sha256(data).hexdigest(), flush=True)
    """
)


def test_hangarinclude_carries_gitignored_data_and_submit_says_what_it_left_out(hangar, tmp_path):
    root = tmp_path / "nanoGPT"
    (root / "data" / "shakespeare_char").mkdir(parents=True)
    (root / "train.py").write_text(READ_DATA)
    (root / ".gitignore").write_text("*.bin\n*.pkl\ninput.txt\n")
    git(root, "init", "-q", "-b", "master")
    git(root, "add", ".")
    git(root, "commit", "-qm", "start")
    data = os.urandom(300_000)
    (root / "data" / "shakespeare_char" / "input.txt").write_bytes(data)
    (root / "data" / "shakespeare_char" / "train.bin").write_bytes(os.urandom(1000))

    code, out, err = hangar("--json", "submit", "-p", "default", "--code", str(root), "--wait", "--", PY, "train.py")
    assert code == 1, err + out  # the job could not find its data: the setup shows it left out
    assert "code: left out by .gitignore: 2 files, 0.3 MB: input.txt (1 file, 0.3 MB), *.bin (1 file" in err
    assert "list them in .hangarinclude" in err
    assert [g["rule"] for g in json.loads(out)["code_packing"]["left_out"]] == ["input.txt", "*.bin"]

    (root / ".hangarinclude").write_text("data/**/input.txt\n")
    job, err = submit_code(hangar, root)
    assert job["state"] == "succeeded"
    assert "code: brought back by .hangarinclude: 1 file, 0.3 MB: data/**/input.txt (1 file, 0.3 MB)" in err
    assert "code: left out by .gitignore: 1 file, 0.0 MB: *.bin (1 file, 0.0 MB)" in err
    packing = job["code_packing"]
    assert packing["snapshot"] == job["code"]["snapshot"] and packing["brought_back"][0]["files"] == 1
    assert f"input.txt {hashlib.sha256(data).hexdigest()}" in printed(hangar, job["id"])


def web_peak_mb(stack) -> dict[int, int]:
    """Each web server process of the stack and its peak resident memory (VmHWM), MB."""
    peaks = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == stack.proc.pid and b"portal.webserver" in (entry / "cmdline").read_bytes():
                status = (entry / "status").read_text()
                peaks[int(entry.name)] = int(status.split("VmHWM:")[1].split()[0]) // 1024
        except (OSError, ValueError, IndexError):
            continue
    return peaks


def test_a_header_bomb_put_to_the_live_server_is_refused_and_its_memory_stays_put(stack, tmp_path):
    bomb = header_bomb()
    put = {**stack.headers(), "Content-Type": "application/gzip"}
    url = f"{stack.url}/api/v1/projects/default/snapshots/{{}}/"
    (tmp_path / "a.py").write_text("x")
    small = pack(tmp_path).data
    ok = httpx.put(url.format(hashlib.sha256(small).hexdigest()), content=small, headers=put, timeout=30)
    assert ok.status_code in (200, 201), ok.text  # the setup: this server takes an upload
    before = web_peak_mb(stack)
    assert before, "no web server process found"
    start = time.perf_counter()
    refused = httpx.put(url.format(hashlib.sha256(bomb).hexdigest()), content=bomb, headers=put, timeout=60)
    elapsed = time.perf_counter() - start
    after = web_peak_mb(stack)
    assert refused.status_code == 400, refused.text
    assert refused.json()["errors"][0]["field"] == "body"
    assert "a tar GNU long name holds 805306368 bytes (768 MiB)" in refused.json()["message"]
    grew = max(after[pid] - before[pid] for pid in before if pid in after)
    assert grew < 50 and elapsed < 5, (before, after, elapsed)
