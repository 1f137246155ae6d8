"""What `hangar submit --code DIR` packs from a nanoGPT-like tree, and what it says it left
out: `.gitignore` leaves the data out (input.txt, *.bin, *.pkl), `.hangarinclude` brings it
back up to the snapshot limit, `.hangarignore` still excludes; in a real git work tree and
in a plain directory. The client needs no Django."""

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hangar.snapshots import SIZED_ENTRIES, SnapshotError, pack

GITIGNORE = "\n".join(
    [".DS_Store", ".idea", ".ipynb_checkpoints/", ".vscode", "__pycache__/", "*.bin", "*.pkl", "*.pt", "*.pyc"]
    + ["input.txt", "env/", "venv/", ""]
)  # nanoGPT's own
CODE = {
    ".gitignore": GITIGNORE,
    "train.py": "import os\nprint('training')\n",
    "model.py": "class GPT: pass\n",
    "config/train_shakespeare_char.py": "out_dir = 'out-shakespeare-char'\n",
    "data/shakespeare_char/prepare.py": "print('prepare')\n",
}
DATA = {  # path: bytes, as prepare.py and a first training run leave them
    "data/shakespeare_char/input.txt": 1_115_394,
    "data/shakespeare_char/train.bin": 2_007_542,
    "data/shakespeare_char/val.bin": 223_058,
    "data/shakespeare_char/meta.pkl": 703,
    "out-shakespeare-char/ckpt.pt": 3_000_000,
    "__pycache__/model.cpython-311.pyc": 1_000,
}


def git(root: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@x", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@x"
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture(params=["git", "plain"])
def nanogpt(request, tmp_path) -> Path:
    root = tmp_path / "nanoGPT"
    for name, text in CODE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if request.param == "git":
        git(root, "init", "-q", "-b", "master")
        git(root, "add", ".")
        git(root, "commit", "-qm", "nanoGPT")
    for name, size in DATA.items():  # made after the commit, as prepare.py makes them
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(os.urandom(size))
    inside = subprocess.run(["git", "-C", str(root), "rev-parse", "--is-inside-work-tree"], capture_output=True)
    assert (inside.returncode == 0) == (request.param == "git")  # the plain tree is in no work tree
    return root


def members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isreg()}


def test_without_hangarinclude_the_data_is_left_out_and_it_says_so(nanogpt):
    packed = pack(nanogpt)
    assert set(members(packed.data)) == set(CODE)
    assert packed.lines() == [
        "left out by .gitignore: 6 files, 6.1 MB: *.pt (1 file, 2.9 MB), *.bin (2 files, 2.1 MB), "
        "input.txt (1 file, 1.1 MB), __pycache__/ (1 file, 0.0 MB) and 1 more rule",
        "to carry files .gitignore leaves out, list them in .hangarinclude (gitignore syntax)",
    ]
    report = packed.report()
    assert [(g["rule"], g["files"], g["bytes"]) for g in report["left_out"]] == [
        ("*.pt", 1, 3_000_000),
        ("*.bin", 2, 2_230_600),
        ("input.txt", 1, 1_115_394),
        ("__pycache__/", 1, 1_000),
        ("*.pkl", 1, 703),
    ]
    assert report["left_out"][1]["examples"] == ["data/shakespeare_char/train.bin", "data/shakespeare_char/val.bin"]
    assert {g["reason"] for g in report["left_out"]} == {".gitignore"} and report["brought_back"] == []
    json.dumps(report)  # what --json prints


def test_hangarinclude_brings_the_data_back_and_hangarignore_still_excludes(nanogpt):
    (nanogpt / ".hangarinclude").write_text("data/**/input.txt\n*.bin\n*.pkl\n")
    (nanogpt / ".hangarignore").write_text("*.pkl\n")
    packed = pack(nanogpt)
    carried = members(packed.data)
    data = "data/shakespeare_char/"
    assert set(carried) == set(CODE) | {".hangarinclude", ".hangarignore"} | {
        f"{data}input.txt",
        f"{data}train.bin",
        f"{data}val.bin",
    }
    assert carried[f"{data}train.bin"] == (nanogpt / data / "train.bin").read_bytes()
    assert packed.lines() == [
        "left out by .gitignore: 2 files, 2.9 MB: *.pt (1 file, 2.9 MB), __pycache__/ (1 file, 0.0 MB)",
        "left out by .hangarignore: 1 file, 0.0 MB: *.pkl (1 file, 0.0 MB)",
        "brought back by .hangarinclude: 3 files, 3.2 MB: *.bin (2 files, 2.1 MB), data/**/input.txt (1 file, 1.1 MB)",
    ]
    assert [(g["reason"], g["rule"]) for g in packed.report()["brought_back"]] == [
        (".hangarinclude", "*.bin"),
        (".hangarinclude", "data/**/input.txt"),
    ]


def test_what_hangarinclude_brings_back_counts_against_the_limit(nanogpt):
    (nanogpt / ".hangarinclude").write_text("*.pt\n")
    with pytest.raises(SnapshotError) as refused:
        pack(nanogpt, limit_mb=2)
    assert "over the 2 MB limit; the biggest: out-shakespeare-char/ckpt.pt (2.9 MB)" in str(refused.value)
    assert "bring back less with .hangarinclude" in str(refused.value)
    assert pack(nanogpt, limit_mb=4).files == len(CODE) + 2


def test_a_tracked_file_is_packed_whatever_gitignore_says_and_rules_name_their_file(tmp_path):
    repo = tmp_path / "repo"
    (repo / "exp" / "sub").mkdir(parents=True)
    (repo / ".gitignore").write_text("*.bin\n")
    (repo / "exp" / "sub" / ".gitignore").write_text("*.tmp\n")
    (repo / "exp" / "tracked.bin").write_text("force-added")
    (repo / "exp" / "train.py").write_text("x")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "add", "-f", "exp/tracked.bin")
    git(repo, "commit", "-qm", "first")
    (repo / "exp" / "new.bin").write_text("untracked")
    (repo / "exp" / "sub" / "a.tmp").write_text("t")
    packed = pack(repo / "exp")
    assert "tracked.bin" in members(packed.data) and "new.bin" not in members(packed.data)
    assert [g["rule"] for g in packed.report()["left_out"]] == ["../.gitignore: *.bin", "sub/.gitignore: *.tmp"]


def test_what_it_says_stays_short_however_many_rules_match(tmp_path):
    (tmp_path / ".gitignore").write_text("".join(f"*.e{i}\n" for i in range(60)))
    (tmp_path / "train.py").write_text("x")
    for i in range(60):
        for j in range(30):
            (tmp_path / f"f{j}.e{i}").write_text("x")
    packed = pack(tmp_path)
    lines = packed.lines()
    assert len(lines) == 2 and len(lines[0]) < 300 and lines[0].endswith("and 56 more rules")
    assert lines[0].startswith("left out by .gitignore: 1800 files, 0.0 MB: ")
    report = packed.report()
    assert len(report["left_out"]) == 20 and all(len(g["examples"]) == 3 for g in report["left_out"])
    assert len(json.dumps(report)) < 5000


# --- directories left out whole (.venv, node_modules) -------------------------------------------


def with_venv(root: Path, dirs: int = 300, files: int = 10) -> Path:
    """`root` with a .venv/ of `dirs` directories of `files` files each, as .gitignore leaves out."""
    (root / "train.py").parent.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text("print('training')\n")
    (root / ".gitignore").write_text(".venv/\n")
    for d in range(dirs):
        (root / ".venv" / f"pkg{d:03}").mkdir(parents=True)
        for f in range(files):
            (root / ".venv" / f"pkg{d:03}" / f"m{f}.py").write_text("x = 1\n")
    return root


COUNT_SCANDIRS = """
import json, sys
sys.path.insert(0, {base!r})
from hangar.snapshots import pack
opened = []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "os.scandir" else None)
packed = pack(sys.argv[1])
venv = [p for p in opened if "/.venv" in p]
print(json.dumps({{"lines": packed.lines(), "left_out": packed.report()["left_out"], "venv_dirs_opened": len(venv)}}))
"""


@pytest.mark.parametrize("kind", ["git", "plain"])
def test_a_directory_left_out_whole_is_counted_within_a_bound_never_walked_through(kind, tmp_path):
    root = with_venv(tmp_path / "proj")
    if kind == "git":
        git(root, "init", "-q")
        git(root, "add", ".")
        git(root, "commit", "-qm", "first")
    script = COUNT_SCANDIRS.format(base=str(Path(__file__).resolve().parent.parent))
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    (group,) = said["left_out"]
    assert (group["rule"], group["complete"]) == (".venv/", False)
    assert 0 < group["files"] <= SIZED_ENTRIES and group["examples"][0] == ".venv/pkg000/m0.py"
    assert said["lines"][0].startswith(f"left out by .gitignore: {group['files']}+ files, ")
    assert f".venv/ ({group['files']}+ files, " in said["lines"][0]
    assert said["venv_dirs_opened"] < 300 // 2, said["venv_dirs_opened"]  # of its 301 directories


@pytest.mark.parametrize("kind", ["git", "plain"])
def test_hangarinclude_looks_into_an_ignored_directory_only_when_a_rule_names_a_path_in_it(kind, tmp_path):
    root = with_venv(tmp_path / "proj", dirs=3, files=2)
    (root / ".gitignore").write_text(".venv/\ndata/\n*.bin\n")
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "sub" / "input.txt").write_text("to be or not")
    (root / "data" / "sub" / "cache.bin").write_text("c")
    (root / "weights.bin").write_text("w")
    if kind == "git":
        git(root, "init", "-q")
        git(root, "add", ".")
        git(root, "commit", "-qm", "first")

    (root / ".hangarinclude").write_text("*.bin\n")  # a bare name: the .bin files left out one by one
    packed = pack(root)
    assert "weights.bin" in members(packed.data) and "data/sub/cache.bin" not in members(packed.data)
    rules = {g["rule"]: (g["files"], g["complete"]) for g in packed.report()["left_out"]}
    assert rules == {"data/": (2, True), ".venv/": (6, True)}

    (root / ".hangarinclude").write_text("data/**/input.txt\n")  # a path in data/
    carried = members(pack(root).data)
    assert "data/sub/input.txt" in carried and "data/sub/cache.bin" not in carried

    (root / ".hangarinclude").write_text("data/\n")  # the directory itself
    packed = pack(root)
    assert {"data/sub/input.txt", "data/sub/cache.bin"} <= set(members(packed.data))
    assert [(g["rule"], g["files"]) for g in packed.report()["brought_back"]] == [("data/", 2)]
    assert not any(name.startswith(".venv/") for name in members(packed.data))


def test_a_directory_inside_an_ignored_one_packs_what_hangarinclude_brings_back(tmp_path):
    repo = tmp_path / "repo"
    (repo / "build" / "exp" / "sub").mkdir(parents=True)
    (repo / ".gitignore").write_text("build/\n")
    (repo / "build" / "exp" / "train.py").write_text("x")
    (repo / "build" / "exp" / "sub" / "u.py").write_text("y")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "first")
    with pytest.raises(SnapshotError, match="nothing to pack"):
        pack(repo / "build" / "exp")
    (repo / "build" / "exp" / ".hangarinclude").write_text("train.py\nsub/\n")
    packed = pack(repo / "build" / "exp")
    assert set(members(packed.data)) == {"train.py", "sub/u.py"}
    assert {g["rule"] for g in packed.report()["brought_back"]} == {"train.py", "sub/"}
