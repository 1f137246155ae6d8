"""Packing a directory into a code snapshot (`hangar submit --code DIR`), with no Django.

What is packed: in a git work tree, what `git ls-files -co --exclude-standard` lists (the
tracked files and the untracked ones .gitignore does not exclude); elsewhere every file
whose path no .gitignore on the way matches. DIR's `.hangarinclude` (gitignore syntax)
brings back files .gitignore leaves out (data, small weights); whatever DIR's
`.hangarignore` (the same syntax) matches is left out all the same, and `.git` always.
A directory .gitignore leaves out whole (.venv, node_modules) is one entry, as git lists
it: looked into only when a .hangarinclude rule names it or a path in it, otherwise only
counted for the report, up to SIZED_ENTRIES. `Packed.left_out` says what was left out, by
which rule, and how much. A symlink whose target lies inside DIR is packed as a relative
symlink, never followed; one that points outside DIR is refused (it would not exist on
the node) with the fix: ignore it, or copy its target in.

The tarball is made the same way every time (sorted paths, no times, owners or umask in
it, gzip without a timestamp), so an unchanged tree has the same sha256 and the server,
asked first, needs nothing uploaded.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import stat
import subprocess
import tarfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from hangar import tarballs

DEFAULT_LIMIT_MB = 100
DIFF_LIMIT_BYTES = 512 * 1024  # the server keeps at most HANGAR_SNAPSHOT_DIFF_MAX_BYTES (default the same)
IGNORE_FILE = ".hangarignore"
INCLUDE_FILE = ".hangarinclude"
GITIGNORE = ".gitignore"
SHOWN_RULES = 4  # rules named per reason on a line of `hangar submit --code`
REPORTED_RULES = 20  # rules per reason in --json
EXAMPLES = 3
SIZED_ENTRIES = 1000  # entries counted in a directory left out whole; past them its figures are "at least"
UNPACK_LIMIT_MB = 1024  # `hangar code`: what a downloaded snapshot may unpack to (the server's limit is lower)
UNPACK_LIMIT_FILES = 1_000_000
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
class Group:
    """Files left out (or brought back) for one reason by one rule."""

    reason: str  # .gitignore, .hangarignore, or .hangarinclude (brought back)
    rule: str  # the pattern; "FILE: pattern" when it is not in DIR's own file of that name
    files: int = 0
    size: int = 0
    examples: list[str] = field(default_factory=list)
    complete: bool = True  # False: a directory too big to count; files and size are at least these

    def add(self, path: str, size: int) -> None:
        self.files, self.size = self.files + 1, self.size + size
        if len(self.examples) < EXAMPLES:
            self.examples.append(path)

    def text(self) -> str:
        return f"{self.rule} ({figures(self.files, self.size, self.complete)})"

    def as_dict(self) -> dict:
        shown = {"reason": self.reason, "rule": self.rule, "files": self.files, "bytes": self.size}
        return shown | {"complete": self.complete, "examples": self.examples}


class Tally:
    """Groups by reason and rule, in the order first seen."""

    def __init__(self):
        self.groups: dict[tuple[str, str], Group] = {}

    def group(self, reason: str, rule: str) -> Group:
        return self.groups.setdefault((reason, rule), Group(reason, rule))

    def add(self, reason: str, rule: str, root: Path, path: str) -> None:
        try:
            size = os.lstat(os.path.join(root, path)).st_size
        except OSError:
            size = 0
        self.group(reason, rule).add(path, size)

    def add_tree(self, reason: str, rule: str, root: Path, directory: str) -> None:
        """The files of `directory`, left out whole, counted without walking past SIZED_ENTRIES
        (a .venv or node_modules holds tens of thousands)."""
        todo, seen = deque([directory.rstrip("/")]), 0
        while todo:
            here = todo.popleft()  # breadth first: the examples are its top files
            try:
                with os.scandir(os.path.join(root, here)) as listing:
                    entries = sorted(listing, key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > SIZED_ENTRIES:
                    self.group(reason, rule).complete = False
                    return
                rel = f"{here}/{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    todo.append(rel)
                else:
                    self.add(reason, rule, root, rel)

    def of(self, reason: str) -> list[Group]:
        return sorted((g for g in self.groups.values() if g.reason == reason), key=lambda g: (-g.size, g.rule))


@dataclass
class Packed:
    data: bytes
    sha256: str
    files: int
    size: int
    git: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    left_out: list[Group] = field(default_factory=list)  # by .gitignore and .hangarignore
    brought_back: list[Group] = field(default_factory=list)  # by .hangarinclude

    def code_field(self) -> dict:
        """The job spec's `code` field for this snapshot."""
        return {"snapshot": self.sha256, **self.git}

    def lines(self) -> list[str]:
        """What `hangar submit --code` says was left out and why (a few lines, however many files)."""
        lines = [summary(f"left out by {why}", self.of(self.left_out, why)) for why in (GITIGNORE, IGNORE_FILE)]
        lines.append(summary(f"brought back by {INCLUDE_FILE}", self.brought_back))
        lines += [f"left out {skipped}" for skipped in self.skipped[:SHOWN_RULES]]
        if len(self.skipped) > SHOWN_RULES:
            lines.append(f"left out {len(self.skipped) - SHOWN_RULES} more that are not regular files")
        if self.of(self.left_out, GITIGNORE) and not self.brought_back:
            lines.append(f"to carry files .gitignore leaves out, list them in {INCLUDE_FILE} (gitignore syntax)")
        return [line for line in lines if line]

    def report(self) -> dict:
        """The same for --json: each reason's rules (the biggest first), with counts and examples."""
        left = [g for why in (GITIGNORE, IGNORE_FILE) for g in self.of(self.left_out, why)[:REPORTED_RULES]]
        return {
            "snapshot": self.sha256,
            "files": self.files,
            "bytes": self.size,
            "left_out": [g.as_dict() for g in left],
            "brought_back": [g.as_dict() for g in self.brought_back[:REPORTED_RULES]],
            "not_files": self.skipped[:REPORTED_RULES],
        }

    @staticmethod
    def of(groups: list[Group], reason: str) -> list[Group]:
        return [g for g in groups if g.reason == reason]


def summary(what: str, groups: list[Group]) -> str:
    if not groups:
        return ""
    files, size = sum(g.files for g in groups), sum(g.size for g in groups)
    shown = ", ".join(g.text() for g in groups[:SHOWN_RULES])
    more = f" and {plural(len(groups) - SHOWN_RULES, 'more rule')}" if len(groups) > SHOWN_RULES else ""
    return f"{what}: {figures(files, size, all(g.complete for g in groups))}: {shown}{more}"


def figures(files: int, size: int, complete: bool) -> str:
    if complete:
        return f"{plural(files, 'file')}, {mb(size)}"
    return f"{files}+ files, {mb(size).replace(' ', '+ ')}"  # at least


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def pack(directory: str | Path, limit_mb: float = DEFAULT_LIMIT_MB) -> Packed:
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise SnapshotError(f"--code {directory}: no such directory; give the directory to run the job in")
    root = root.resolve()
    tally = Tally()
    entries, skipped = collect(root, tally)
    if not entries:
        raise SnapshotError(
            f"--code {directory}: nothing to pack (no file, or every file ignored by .gitignore or {IGNORE_FILE})"
        )
    check_size(entries, limit_mb, directory, bool(tally.of(INCLUDE_FILE)))
    data = tarball(root, entries)
    regular = [e for e in entries if e.link is None]
    return Packed(
        data=data,
        sha256=hashlib.sha256(data).hexdigest(),
        files=len(entries),
        size=sum(e.size for e in regular),
        git=git_facts(root),
        skipped=skipped,
        left_out=tally.of(GITIGNORE) + tally.of(IGNORE_FILE),
        brought_back=tally.of(INCLUDE_FILE),
    )


# --- which files ------------------------------------------------------------------


def collect(root: Path, tally: Tally) -> tuple[list[Entry], list[str]]:
    """The entries to pack, sorted, and what was left out as not a file (sockets, fifos);
    what the ignore files left out or brought back goes to `tally`."""
    paths, gitignored = listed(root)
    include, ignore = ignore_spec(root / INCLUDE_FILE), ignore_spec(root / IGNORE_FILE)
    brought = set()
    for rel, rule in gitignored.items():
        if rel.endswith("/"):
            brought.update(from_ignored_directory(root, rel, rule, include, tally))
        elif rule_of(include, rel) is not None:
            brought.add(rel)
        else:
            tally.add(GITIGNORE, rule, root, rel)
    wanted = set(paths) | brought
    entries, skipped, outside = [], [], []
    for rel in sorted(wanted):
        if rel == ".git" or rel.startswith(".git/"):
            continue
        if (rule := rule_of(ignore, rel)) is not None:
            tally.add(IGNORE_FILE, rule, root, rel)
            continue
        entry, problem = entry_for(root, rel)
        if problem == "outside":
            outside.append(f"{rel} -> {os.readlink(root / rel)}")
        elif problem:
            skipped.append(f"{rel} ({problem})")
        elif entry is not None:
            entries.append(entry)
            if rel in brought:
                tally.add(INCLUDE_FILE, rule_of(include, rel), root, rel)
    if outside:
        shown = "; ".join(outside[:5]) + (f"; and {len(outside) - 5} more" if len(outside) > 5 else "")
        raise SnapshotError(
            f"--code {root}: symlinks point outside the directory and would not exist on the node: {shown}. "
            f"Add them to {IGNORE_FILE}, or copy what they point to into the directory"
        )
    return entries, skipped


def from_ignored_directory(root: Path, directory: str, rule: str, include, tally: Tally) -> list[str]:
    """The files .hangarinclude brings back from `directory` (which .gitignore leaves out
    whole); the rest goes to `tally` under `rule`. Walked only when an include rule names it
    or a path in it: otherwise it is only counted."""
    if rule_of(include, directory) is None and not any(enters(p, directory) for p in include_patterns(include)):
        tally.add_tree(GITIGNORE, rule, root, directory)
        return []
    brought = []
    for rel in files_under(root, directory):
        if rule_of(include, rel) is not None:
            brought.append(rel)
        else:
            tally.add(GITIGNORE, rule, root, rel)
    return brought


def include_patterns(spec) -> list[str]:
    return [] if spec is None else [p.pattern for p in spec.patterns if p.include]


def enters(pattern: str, directory: str) -> bool:
    """Whether `pattern` may match a path below `directory`: it has a slash before its end and
    its leading names fit the directory's (`data/**/*.bin`; `**/x` fits any). A bare name
    (`*.bin`) matches what .gitignore leaves out file by file: like git's own rules, it does
    not reach into a directory left out whole."""
    names, parts = pattern.strip("/").split("/"), directory.rstrip("/").split("/")
    for name, part in zip(names, parts, strict=False):
        if name == "**":
            return len(names) > 1
        # fnmatch reads escapes and [^...] otherwise than git: such a name is taken to fit.
        if not ("\\" in name or "[" in name or fnmatch.fnmatchcase(part, name)):
            return False
    return len(names) > len(parts)


def files_under(root: Path, directory: str) -> list[str]:
    """Every file and symlink under `directory` (a symlinked directory is one, never walked)."""
    found = []
    for here, dirs, files in os.walk(root / directory, followlinks=False):
        rel_dir = os.path.relpath(here, root).replace(os.sep, "/")
        links = [d for d in dirs if os.path.islink(os.path.join(here, d))]
        dirs[:] = [d for d in dirs if d != ".git" and d not in links]
        found += [f"{rel_dir}/{name}" for name in [*files, *links]]
    return found


def listed(root: Path) -> tuple[list[str], dict[str, str]]:
    """What git would commit from `root` (outside git: what no .gitignore matches), and what
    .gitignore leaves out, each path with the rule that does: files, and a directory left out
    whole as one path ending in "/"."""
    paths = git_paths(root)
    if paths is None:
        return walked_paths(root)
    return paths, git_ignored(root)


def rule_of(spec, rel: str) -> str | None:
    """The pattern of `spec` that matches `rel` (None: none does, or a `!pattern` re-includes it)."""
    if spec is None:
        return None
    result = spec.check_file(rel)
    return spec.patterns[result.index].pattern if result.include else None


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


def git_ignored(root: Path) -> dict[str, str]:
    """What .gitignore (or .git/info/exclude, or git's global excludes) leaves out, each path
    with its rule as `git check-ignore -v` names it. `git status --ignored=matching` lists a
    directory an ignore rule matches as one path, never reading into it (ls-files -oi would)."""
    status = git(root, "status", "--porcelain", "-z", "--ignored=matching", "-unormal", "--no-renames", "--", ".")
    prefix = (git(root, "rev-parse", "--show-prefix") or "").strip()
    paths = ignored_paths(status or "", prefix, root)
    if not paths:
        return {}
    answer = git(root, "check-ignore", "-v", "-z", "--stdin", stdin="\0".join(paths) + "\0", ok=(0, 1)) or ""
    fields = answer.split("\0")
    rules = {}
    for source, _, pattern, path in zip(fields[0::4], fields[1::4], fields[2::4], fields[3::4], strict=False):
        if not os.path.isabs(source):
            source = os.path.relpath(source, prefix or ".")
        rules[path] = pattern if source == GITIGNORE else f"{source}: {pattern}"
    return {path: rules.get(path, GITIGNORE) for path in paths}


def ignored_paths(status: str, prefix: str, root: Path) -> list[str]:
    """The `!!` paths of `git status --porcelain -z`, relative to `root` (git names them from
    the top of the work tree). When `root` itself lies in an ignored directory, what is in it."""
    paths = []
    for line in status.split("\0"):
        if not line.startswith("!! "):
            continue
        path = line[3:]
        if path.endswith("/") and prefix.startswith(path):  # root is in it: so is each of its entries
            with os.scandir(root) as entries:
                return [e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries if e.name != ".git"]
        paths.append(path.removeprefix(prefix))
    return paths


def walked_paths(root: Path) -> tuple[list[str], dict[str, str]]:
    """Every file under `root` that no .gitignore on its way matches, and what one does leave
    out with its rule: files, and a directory as one path ending in "/" (not walked, as git)."""
    specs: list[tuple[str, object]] = []  # (directory relative to root, its .gitignore spec)
    found: list[str] = []
    gitignored: dict[str, str] = {}
    for here, dirs, files in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(here, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        specs = [(base, spec) for base, spec in specs if rel_dir == base or rel_dir.startswith(base + "/") or not base]
        spec = ignore_spec(Path(here) / GITIGNORE)
        if spec is not None:
            specs.append((rel_dir, spec))
        kept_dirs = []
        for name in sorted(dirs):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if name == ".git":
                continue
            if os.path.islink(os.path.join(here, name)):  # packed as a symlink, never walked into
                files.append(name)
            elif rule := ignored(rel + "/", specs):
                gitignored[rel + "/"] = rule
            else:
                kept_dirs.append(name)
        dirs[:] = kept_dirs
        for name in files:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if rule := ignored(rel, specs):
                gitignored[rel] = rule
            else:
                found.append(rel)
    return found, gitignored


def ignored(rel: str, specs: list[tuple[str, object]]) -> str | None:
    """The rule that ignores `rel`: the deepest .gitignore with a rule for it decides (a later
    `!rule` re-includes)."""
    for base, spec in reversed(specs):
        inner = rel[len(base) + 1 :] if base else rel
        result = spec.check_file(inner)
        if result.include is not None:
            pattern = spec.patterns[result.index].pattern
            return (pattern if not base else f"{base}/{GITIGNORE}: {pattern}") if result.include else None
    return None


def ignore_spec(path: Path):
    if not path.is_file():
        return None
    try:
        import pathspec
    except ImportError:
        raise SnapshotError(f"reading {path} needs pathspec: pip install pathspec")
    return pathspec.GitIgnoreSpec.from_lines(path.read_text(errors="replace").splitlines())


def check_size(entries: list[Entry], limit_mb: float, directory, included: bool = False) -> None:
    total = sum(e.size for e in entries)
    if total <= limit_mb * 1024 * 1024:
        return
    biggest = sorted((e for e in entries if e.link is None), key=lambda e: e.size, reverse=True)[:5]
    shown = ", ".join(f"{e.path} ({mb(e.size)})" for e in biggest)
    less = f", bring back less with {INCLUDE_FILE}" if included else ""
    raise SnapshotError(
        f"--code {directory}: {len(entries)} files of {mb(total)}, over the {limit_mb:g} MB limit; "
        f"the biggest: {shown}. Add what the job does not need to {IGNORE_FILE} (or .gitignore){less}, "
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


def git(root: Path, *args: str, stdin: str | None = None, ok: tuple[int, ...] = (0,)) -> str | None:
    feed = {"input": stdin.encode()} if stdin is not None else {"stdin": subprocess.DEVNULL}
    try:
        # No optional locks: `git status` would take the index lock of the user's own git commands.
        argv = ["git", "--no-optional-locks", "-C", str(root), *args]
        done = subprocess.run(argv, capture_output=True, timeout=GIT_TIMEOUT, **feed)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode(errors="replace") if done.returncode in ok else None


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
    """A downloaded snapshot checked and unpacked into `directory` within the server's bounds
    and checks (hangar/tarballs.py: nothing lands outside it, any Python 3.11); the number of
    members."""
    limit_bytes, limit_files = UNPACK_LIMIT_MB * 1024 * 1024, UNPACK_LIMIT_FILES
    try:
        contents = tarballs.check_tarball(io.BytesIO(data), limit_bytes, limit_files)
        limit = tarballs.stream_limit(limit_bytes, limit_files)
        return tarballs.extract(io.BytesIO(data), Path(directory), contents, limit)
    except tarballs.SnapshotRefused as refused:
        raise SnapshotError(f"the code snapshot cannot be unpacked: {refused.message}")
