"""Packing a directory into a code snapshot (`hangar submit --code DIR`), with no Django.

What is packed: in a git work tree, what `git ls-files -co --exclude-standard` lists (the
tracked files and the untracked ones .gitignore does not exclude); elsewhere every file
whose path no .gitignore on the way matches. Then whatever DIR's `.hangarignore` (the
same syntax) matches is left out too, and `.git` always. A symlink whose target lies
inside DIR is packed as a relative symlink, never followed; one that points outside DIR
is refused (it would not exist on the node) with the fix: ignore it, or copy its target in.

The tarball is made the same way every time (sorted paths, no times, owners or umask in
it, gzip without a timestamp), so an unchanged tree has the same sha256 and the server,
asked first, needs nothing uploaded.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_LIMIT_MB = 100
DIFF_LIMIT_BYTES = 512 * 1024  # the server keeps at most HANGAR_SNAPSHOT_DIFF_MAX_BYTES (default the same)
IGNORE_FILE = ".hangarignore"
GIT_TIMEOUT = 30
COMPRESS_LEVEL = 1  # code compresses well even at 1; level 6 cost 4x the time on 20 MB for a few % less


class SnapshotError(Exception):
    """DIR cannot be packed; the message says why and what to change."""


@dataclass
class Entry:
    path: str  # relative, with /
    size: int = 0
    link: str | None = None  # a symlink's (relative) target
    executable: bool = False


@dataclass
class Packed:
    data: bytes
    sha256: str
    files: int
    size: int
    git: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def code_field(self) -> dict:
        """The job spec's `code` field for this snapshot."""
        return {"snapshot": self.sha256, **self.git}


def pack(directory: str | Path, limit_mb: float = DEFAULT_LIMIT_MB) -> Packed:
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise SnapshotError(f"--code {directory}: no such directory; give the directory to run the job in")
    root = root.resolve()
    entries, skipped = collect(root)
    if not entries:
        raise SnapshotError(
            f"--code {directory}: nothing to pack (no file, or every file ignored by .gitignore or {IGNORE_FILE})"
        )
    check_size(entries, limit_mb, directory)
    data = tarball(root, entries)
    regular = [e for e in entries if e.link is None]
    return Packed(
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        files=len(entries),
        size=sum(e.size for e in regular),
        git=git_facts(root),
        skipped=skipped,
    )


# --- which files ------------------------------------------------------------------


def collect(root: Path) -> tuple[list[Entry], list[str]]:
    """The entries to pack, sorted, and what was left out as not a file (sockets, fifos)."""
    paths = git_paths(root)
    if paths is None:
        paths = walked_paths(root)
    ignore = ignore_spec(root / IGNORE_FILE)
    entries, skipped, outside = [], [], []
    for rel in sorted(set(paths)):
        if rel == ".git" or rel.startswith(".git/") or (ignore is not None and ignore.match_file(rel)):
            continue
        entry, problem = entry_for(root, rel)
        if problem == "outside":
            outside.append(f"{rel} -> {os.readlink(root / rel)}")
        elif problem:
            skipped.append(f"{rel} ({problem})")
        elif entry is not None:
            entries.append(entry)
    if outside:
        shown = "; ".join(outside[:5]) + (f"; and {len(outside) - 5} more" if len(outside) > 5 else "")
        raise SnapshotError(
            f"--code {root}: symlinks point outside the directory and would not exist on the node: {shown}. "
            f"Add them to {IGNORE_FILE}, or copy what they point to into the directory"
        )
    return entries, skipped


def entry_for(root: Path, rel: str) -> tuple[Entry | None, str]:
    path = root / rel
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None, ""  # listed by git but deleted in the work tree
    if stat.S_ISLNK(info.st_mode):
        try:
            os.path.realpath(path, strict=True)
        except FileNotFoundError:
            pass  # dangling: packed as it is, it may point to what the job makes
        except OSError:
            return None, "a symlink loop"
        target = Path(os.path.realpath(path))
        if target != root and root not in target.parents:
            return None, "outside"
        return Entry(rel, link=os.path.relpath(target, root / os.path.dirname(rel))), ""
    if stat.S_ISDIR(info.st_mode):
        return None, "a git submodule: its files are not packed"
    if not stat.S_ISREG(info.st_mode):
        return None, "not a regular file"
    return Entry(rel, size=info.st_size, executable=bool(info.st_mode & 0o111)), ""


def git_paths(root: Path) -> list[str] | None:
    """What git would commit from `root` (tracked and untracked, not ignored); None outside git."""
    listed = git(root, "ls-files", "-co", "--exclude-standard", "-z")
    if listed is None:
        return None
    return [p for p in listed.split("\0") if p]


def walked_paths(root: Path) -> list[str]:
    """Every file under `root` that no .gitignore on its way matches (directories pruned as git does)."""
    specs: list[tuple[str, object]] = []  # (directory relative to root, its .gitignore spec)
    found: list[str] = []
    for here, dirs, files in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(here, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        specs = [(base, spec) for base, spec in specs if rel_dir == base or rel_dir.startswith(base + "/") or not base]
        spec = ignore_spec(Path(here) / ".gitignore")
        if spec is not None:
            specs.append((rel_dir, spec))
        kept_dirs = []
        for name in sorted(dirs):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if name == ".git" or ignored(rel + "/", specs):
                continue
            if os.path.islink(os.path.join(here, name)):
                found.append(rel)  # packed as a symlink, never walked into
            else:
                kept_dirs.append(name)
        dirs[:] = kept_dirs
        found += [f"{rel_dir}/{n}" if rel_dir else n for n in files if not ignored(f"{rel_dir}/{n}".lstrip("/"), specs)]
    return found


def ignored(rel: str, specs: list[tuple[str, object]]) -> bool:
    """The deepest .gitignore with a rule for `rel` decides (a later `!rule` re-includes)."""
    for base, spec in reversed(specs):
        inner = rel[len(base) + 1 :] if base else rel
        result = spec.check_file(inner)
        if result.include is not None:
            return bool(result.include)
    return False


def ignore_spec(path: Path):
    if not path.is_file():
        return None
    try:
        import pathspec
    except ImportError:
        raise SnapshotError(f"reading {path} needs pathspec: pip install pathspec")
    return pathspec.GitIgnoreSpec.from_lines(path.read_text(errors="replace").splitlines())


def check_size(entries: list[Entry], limit_mb: float, directory) -> None:
    total = sum(e.size for e in entries)
    if total <= limit_mb * 1024 * 1024:
        return
    biggest = sorted((e for e in entries if e.link is None), key=lambda e: e.size, reverse=True)[:5]
    shown = ", ".join(f"{e.path} ({mb(e.size)})" for e in biggest)
    raise SnapshotError(
        f"--code {directory}: {len(entries)} files of {mb(total)}, over the {limit_mb:g} MB limit; "
        f"the biggest: {shown}. Add what the job does not need to {IGNORE_FILE} (or .gitignore), "
        "or raise the limit with --code-limit MB (the server's HANGAR_SNAPSHOT_MAX_MB still applies)"
    )


def mb(size: int) -> str:
    return f"{size / 1024 / 1024:.1f} MB"


# --- the tarball ------------------------------------------------------------------------


def tarball(root: Path, entries: list[Entry]) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=COMPRESS_LEVEL, mtime=0, filename="") as zipped:
        with tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in entries:
                info = tarfile.TarInfo(entry.path)
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                if entry.link is not None:
                    info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.link, 0o777
                    tar.addfile(info)
                    continue
                info.mode = 0o755 if entry.executable else 0o644
                with (root / entry.path).open("rb") as content:
                    info.size = os.fstat(content.fileno()).st_size  # as read now, should it have changed
                    tar.addfile(info, content)
    return out.getvalue()


# --- git --------------------------------------------------------------------------------


def git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, timeout=GIT_TIMEOUT, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode(errors="replace") if done.returncode == 0 else None


def git_facts(root: Path) -> dict:
    """Where DIR is in a git work tree: its commit, branch, whether it is dirty, and the diff."""
    if git(root, "rev-parse", "--is-inside-work-tree") is None:
        return {}
    commit = (git(root, "rev-parse", "--verify", "-q", "HEAD") or "").strip()
    branch = (git(root, "symbolic-ref", "--short", "-q", "HEAD") or "").strip()
    dirty = bool((git(root, "status", "--porcelain") or "").strip())
    diff = (git(root, "diff", "HEAD") or "").replace("\0", "") if dirty and commit else ""
    raw = diff.encode()
    truncated = len(raw) > DIFF_LIMIT_BYTES
    if truncated:
        diff = raw[:DIFF_LIMIT_BYTES].decode(errors="ignore")
    return {"commit": commit, "branch": branch, "dirty": dirty, "diff": diff, "diff_truncated": truncated}


def unpack(data: bytes, directory: Path) -> int:
    """A downloaded snapshot unpacked into `directory` (tarfile's `data` filter: nothing lands
    outside it); the number of members."""
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        tar.extractall(directory, members=members, filter="data")
    return len(members)
