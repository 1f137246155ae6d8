"""Cached Python environments: one virtualenv per exact requirement set, per node, built by uv.

A job's requirements (its own and its environment's: jobs/models/environment.py) and Python
version are resolved to an exact list of packages (`uv pip compile`); that list, the
interpreter's exact version and the platform hash to the environment's name. It is built
once (`uv venv --relocatable`, `uv pip sync`, wheels only: building it runs no code of the
job's) into a temporary folder, renamed into place when complete: a build killed mid-way
leaves nothing a later job uses, and the next build of that hash sweeps it. Jobs needing a
hash being built wait for that build (a file lock), and a later job with the same
requirements finds the resolution it mapped to (keys/) and starts without resolving again.

Layout of HANGAR_ENV_CACHE_DIR (0755, files 0644: job uids read, never write, and a sandbox
binds the environment read-only):

    envs/<hash>/                a complete environment; hangar-env.json in it says what it holds
    envs/.build-<hash>-<pid>/   a build in progress (or killed: swept)
    keys/<key>                  the hash a requirement key resolved to; its mtime: when
    locks/<hash>                flock: exclusive to build or evict, shared while a job uses it
    usage/<hash>                job ids that used it, one a line; its mtime: last used
    uv/                         uv's download cache
"""

import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from jobs.models import FailureClass
from jobs.models.environment import job_requirements, requirements_key

log = logging.getLogger("hangar.agent")

META = "hangar-env.json"
HASH_VERSION = "hangar-env-1"
POLL_SECONDS = 0.2
SAY = Callable[[str], None]
PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec must not dlopen


class BuildFailed(Exception):
    """The environment could not be made: the attempt fails with this reason and failure class."""

    def __init__(self, reason: str, failure_class: str = FailureClass.USER):
        super().__init__(reason)
        self.reason = reason
        self.failure_class = failure_class


class Stopped(Exception):
    """The attempt was cancelled or ended while its environment was resolved or built."""


# --- pure parts ---------------------------------------------------------------------------


def env_hash(resolved: list[str], python: str, interpreter: str = "") -> str:
    """The environment's name: its exact packages, the interpreter (implementation, version,
    platform) they were resolved for, and where that interpreter is (another one of the same
    version is another environment: its links point elsewhere)."""
    text = json.dumps([HASH_VERSION, python, sorted(resolved), interpreter])
    return hashlib.sha256(text.encode()).hexdigest()


def pinned(output: str) -> list[str]:
    """The exact packages of `uv pip compile`'s output (comments and blank lines dropped)."""
    return sorted(line.strip() for line in output.splitlines() if line.strip() and not line.lstrip().startswith("#"))


_NOT_FOUND = re.compile(r"Because (?P<pkg>[A-Za-z0-9][\w.\-]*)(?:\[[^\]]*\])? was not found in the package registry")
_NO_VERSION = re.compile(r"Because there (?:is|are) no versions? of (?P<pkg>[A-Za-z0-9][\w.\-]*)")
_ONLY_SDIST = re.compile(r"(?P<pkg>[A-Za-z0-9][\w.\-]*)(?:==\S+)? (?:has no usable wheels|was not found in the cache)")
_REQUIRE = re.compile(r"you require (?P<pkg>[A-Za-z0-9][\w.\-]*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def resolver_failure(output: str) -> tuple[str, str]:
    """(the package named, the resolver's message) from uv's error output."""
    text = _ANSI.sub("", output)
    lines = [line.strip(" ×╰─▶│").strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith(("Using ", "Resolved ", "warning:"))]
    message = " ".join(lines)[:600] or "uv gave no message"
    for pattern in (_NOT_FOUND, _NO_VERSION, _ONLY_SDIST, _REQUIRE):
        if match := pattern.search(text):
            return match["pkg"], message
    return "", message


def failure_reason(output: str) -> str:
    package, message = resolver_failure(output)
    named = f"package {package!r}: " if package else ""
    return f"environment build failed: {named}{message}"


@dataclass(frozen=True)
class Entry:
    hash: str
    size_bytes: int
    last_used: float


def choose_evictions(entries: list[Entry], budget_bytes: float, keep: set[str]) -> list[str]:
    """Least recently used first, until the rest fits in the budget; never one in `keep`."""
    total = sum(e.size_bytes for e in entries)
    out = []
    for entry in sorted(entries, key=lambda e: (e.last_used, e.hash)):
        if total <= budget_bytes:
            break
        if entry.hash in keep:
            continue
        out.append(entry.hash)
        total -= entry.size_bytes
    return out


# --- the cache on disk ----------------------------------------------------------------------


class Cache:
    def __init__(self, root: Path):
        self.root = Path(root)

    def dir(self, name: str) -> Path:
        path = self.root / name
        if not path.is_dir():
            for folder in (self.root, path):
                folder.mkdir(parents=True, exist_ok=True)
                folder.chmod(0o755)  # Hangar's umask is 077: job uids must read environments
        return path

    def env(self, hash_: str) -> Path:
        return self.root / "envs" / hash_

    def complete(self, hash_: str) -> bool:
        return (self.env(hash_) / META).is_file()

    def usable(self, hash_: str, interpreter: str) -> bool:
        """Complete, built from `interpreter` (the one the node would choose now) and checked
        to run as a job uid, and that interpreter still there (bin/python links to it)."""
        if not self.complete(hash_) or not (self.env(hash_) / "bin" / "python").exists():
            return False
        meta = self.meta(hash_)
        return meta.get("interpreter") == interpreter and bool(meta.get("checked_as_job"))

    def meta(self, hash_: str) -> dict:
        try:
            return json.loads((self.env(hash_) / META).read_text())
        except (OSError, ValueError):
            return {}

    def resolved(self, key: str, max_age: float) -> str | None:
        """The hash `key` resolved to on this node, if it did so less than `max_age` s ago."""
        path = self.root / "keys" / key
        try:
            if time.time() - path.stat().st_mtime > max_age:
                return None
            return path.read_text().strip() or None
        except OSError:
            return None

    def remember(self, key: str, hash_: str) -> None:
        path = self.dir("keys") / key
        tmp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(hash_)
        os.replace(tmp, path)

    def lock(self, hash_: str) -> int:
        return os.open(self.dir("locks") / hash_, os.O_RDWR | os.O_CREAT, 0o600)

    def used(self, hash_: str, job_id: int) -> None:
        fd = os.open(self.dir("usage") / hash_, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, f"{job_id}\n".encode())  # one small append: atomic, and the mtime is "last used"
        finally:
            os.close(fd)

    def entries(self) -> list[Entry]:
        envs = self.root / "envs"
        out = []
        for path in envs.iterdir() if envs.is_dir() else []:
            if path.name.startswith(".") or not self.complete(path.name):
                continue
            try:
                last = (self.root / "usage" / path.name).stat().st_mtime
            except OSError:
                last = path.stat().st_mtime
            out.append(Entry(path.name, int(self.meta(path.name).get("size_bytes", 0)), last))
        return out

    def remove(self, hash_: str) -> None:
        """Evict one environment (its exclusive lock held): out of sight at once, then deleted."""
        gone = self.root / "envs" / f".evict-{hash_}-{os.getpid()}"
        os.rename(self.env(hash_), gone)
        shutil.rmtree(gone, ignore_errors=True)
        (self.root / "usage" / hash_).unlink(missing_ok=True)
        for key in (self.root / "keys").iterdir():
            if key.is_file() and not key.name.startswith(".") and key.read_text().strip() == hash_:
                key.unlink(missing_ok=True)

    def sweep(self, hash_: str) -> None:
        """Builds (and evictions) of `hash_` a killed agent left (its exclusive lock held: none runs)."""
        for pattern in (f".build-{hash_}-*", f".evict-{hash_}-*"):
            for path in (self.root / "envs").glob(pattern):
                shutil.rmtree(path, ignore_errors=True)


def cache() -> Cache:
    return Cache(settings.HANGAR_ENV_CACHE_DIR)


# --- uv and interpreters ----------------------------------------------------------------------


@functools.cache
def uv_binary(configured: str) -> str:
    if configured:
        found = shutil.which(configured)
    else:
        try:
            from uv import find_uv_bin
        except ImportError:
            find_uv_bin = None
        found = find_uv_bin() if find_uv_bin else shutil.which("uv")
    if not found:
        raise BuildFailed("uv is not installed on this node: pip install uv (requirements.txt)", FailureClass.INFRA)
    return os.path.abspath(found)


def uv_env(root: Path) -> dict[str, str]:
    """uv's environment: the agent's PATH and index settings, no downloads of interpreters, no colour."""
    kept = {k: v for k, v in os.environ.items() if k.startswith(("UV_INDEX", "UV_DEFAULT_INDEX", "UV_EXTRA_INDEX"))}
    kept.update({k: os.environ[k] for k in ("PATH", "HOME", "LANG", "SSL_CERT_FILE") if k in os.environ})
    return {
        **kept,
        "UV_CACHE_DIR": str(root / "uv"),
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_CONFIG": "1",
        "NO_COLOR": "1",
        "UV_NO_PROGRESS": "1",
    }


IDENT = (
    "import platform, sys, sysconfig; "
    "print(sys.executable); print(f'{platform.python_implementation().lower()}-{platform.python_version()}-"
    "{sysconfig.get_platform()}')"
)


@functools.cache
def interpreter(path: str) -> tuple[str, str] | None:
    """(its real executable, e.g. cpython-3.11.7-linux-x86_64), or None if it does not run."""
    try:
        done = subprocess.run([path, "-I", "-c", IDENT], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return (lines[0], lines[1]) if done.returncode == 0 and len(lines) == 2 else None


def candidates(version: str) -> list[str]:
    if settings.HANGAR_ENV_PYTHONS:
        return list(settings.HANGAR_ENV_PYTHONS)
    names = [f"python{version}"] if version.count(".") == 1 else []
    names += ["python3"] if not version or version.count(".") != 1 else [f"python{version.rsplit('.', 1)[0]}"]
    names += [f"python3.{minor}" for minor in range(8, 16)] if version else []
    return [p for p in dict.fromkeys(shutil.which(n) for n in names) if p]


def find_python(version: str) -> tuple[str, str]:
    """The interpreter for `version` ("3.11", "3.11.7"; "": the node's default) found on this node.
    uv cannot download interpreters here: only those present count, and the error lists them."""
    found = [i for i in (interpreter(p) for p in candidates(version)) if i is not None]
    for exe, ident in found:
        number = ident.split("-")[1]
        if not version or number == version or number.startswith(version + "."):
            return exe, ident
    have = ", ".join(sorted({ident.split("-")[1] for _, ident in found})) or "none"
    raise BuildFailed(
        f"environment build failed: Python {version or '3'} is not on this node (it has: {have}; interpreters are "
        "not downloaded here): ask for one of those in python_version, or have the operator install it "
        "(HANGAR_ENV_PYTHONS)"
    )


# --- preparing a job's environment ------------------------------------------------------------


@dataclass
class Prepared:
    """A job's environment, held (a shared lock: eviction leaves it alone) until `close`."""

    path: Path
    hash: str
    record: dict
    fd: int | None = None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing it releases the lock
            self.fd = None


def prepare(job, say: SAY, still_current: Callable[[], bool]) -> Prepared | None:
    """The job's cached environment on this node, built if it must be; None when it asks for none.
    Raises BuildFailed (the attempt fails, as the user's unless the node is at fault) or
    Stopped (the attempt ended meanwhile). `say` writes a `[hangar]` line into the job's log."""
    requirements, version = job_requirements(job)
    if not requirements:
        return None
    store, key = cache(), requirements_key(requirements, version)
    exe, ident = find_python(version)  # the interpreter is part of what is cached: a change builds anew
    known = store.resolved(key, settings.HANGAR_ENV_RESOLVE_SECONDS)
    if known and (held := hold_shared(store, known, exe)) is not None:
        store.used(known, job.pk)
        say(f"environment {known[:12]} cached on this node: no build ({len(held.record['packages'])} packages)")
        return held
    started = time.monotonic()
    say(f"resolving {len(requirements)} requirement(s) for {ident} with uv")
    compile_ = ["pip", "compile", "-", "--python", exe, "--no-header", "--no-annotate", "--no-build", "--quiet"]
    resolved = pinned(run_uv(store, compile_, say, still_current, stdin="\n".join(requirements)))
    hash_ = env_hash(resolved, ident, exe)
    store.remember(key, hash_)
    named = job.environment.name if job.environment is not None and job.environment.cached else ""
    prepared = build_or_wait(store, hash_, Build(exe, ident, resolved, named), say, still_current)
    store.used(hash_, job.pk)
    prepared.record["prepare_seconds"] = round(time.monotonic() - started, 3)
    return prepared


def hold_shared(store: Cache, hash_: str, interpreter: str) -> Prepared | None:
    """A shared hold on a usable environment, or None (absent, evicted meanwhile, or its
    interpreter gone or changed: then it is resolved again, for the interpreter the node has now)."""
    if not store.usable(hash_, interpreter):
        return None
    fd = store.lock(hash_)
    fcntl.flock(fd, fcntl.LOCK_SH)  # an eviction holds it exclusively only while it removes
    if not store.usable(hash_, interpreter):
        os.close(fd)
        return None
    meta = store.meta(hash_)
    record = {"hash": hash_, "python": meta.get("python", ""), "packages": meta.get("packages", []), "cached": True}
    return Prepared(store.env(hash_), hash_, record, fd)


@dataclass(frozen=True)
class Build:
    """What an environment is built from: the interpreter, its name, the exact packages, and the
    named environment it serves (for `hangar env rebuild NAME`), if any."""

    exe: str
    ident: str
    resolved: list[str]
    environment: str = ""


def build_or_wait(store, hash_, what: Build, say: SAY, still_current) -> Prepared:
    fd = store.lock(hash_)
    try:
        exclusive = wait_exclusive(fd, hash_, say, still_current, lambda: store.complete(hash_))
        built = exclusive and not store.complete(hash_)
        if built:
            store.sweep(hash_)
            build(store, hash_, what, say, still_current)
            evict(store, keep={hash_})
        else:
            say(f"environment {hash_[:12]} is built on this node already (by another job meanwhile): no build")
        fcntl.flock(fd, fcntl.LOCK_SH)  # not atomic: the entry is checked again below
    except BaseException:
        os.close(fd)
        raise
    if not store.complete(hash_):
        os.close(fd)
        raise BuildFailed(f"environment {hash_[:12]} was evicted as it was built; retrying", FailureClass.INFRA)
    meta = store.meta(hash_)
    record = {"hash": hash_, "python": what.ident, "packages": meta.get("packages", what.resolved), "cached": not built}
    if built:
        record["build_seconds"] = meta.get("build_seconds")
    return Prepared(store.env(hash_), hash_, record, fd)


def wait_exclusive(fd: int, hash_: str, say: SAY, still_current, complete: Callable[[], bool]) -> bool:
    """True once this process holds the lock exclusively (to build); False when the environment
    became complete meanwhile: the job that built it holds it shared for as long as it runs (a
    rank of the same attempt on another agent of this host among them), so waiting on would
    never end."""
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if complete():
                return False
        if not announced:
            announced = True
            say(f"waiting for environment {hash_[:12]}: another job on this node is building it")
        if not still_current():
            raise Stopped()
        time.sleep(POLL_SECONDS)


def build(store: Cache, hash_: str, what: Build, say: SAY, still_current) -> None:
    """Build into a temporary folder, check that a job's uid can run its Python there, then
    rename it into place: complete and runnable, or not there at all."""
    started = time.monotonic()
    tmp = store.dir("envs") / f".build-{hash_}-{os.getpid()}"
    resolved = what.resolved
    say(f"building environment {hash_[:12]} ({len(resolved)} packages, {what.ident})")
    try:
        run_uv(store, ["venv", "--relocatable", "--quiet", "--python", what.exe, str(tmp)], say, still_current)
        (tmp / "hangar-requirements.txt").write_text("\n".join(resolved) + "\n")
        sync = ["pip", "sync", "--python", str(tmp / "bin" / "python"), "--no-build", "--compile-bytecode"]
        run_uv(store, [*sync, str(tmp / "hangar-requirements.txt")], say, still_current)
        for path in (tmp, tmp / "hangar-requirements.txt"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        check_as_job(tmp, hash_)
        seconds = round(time.monotonic() - started, 3)
        meta = {"hash": hash_, "python": what.ident, "interpreter": what.exe, "packages": resolved,
                "environment": what.environment, "checked_as_job": True, "build_seconds": seconds,
                "built_at": timezone.now().isoformat(), "size_bytes": tree_size(tmp)}  # fmt: skip
        (tmp / META).write_text(json.dumps(meta))
        (tmp / META).chmod(0o644)
        os.rename(tmp, store.env(hash_))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"environment {hash_[:12]} built in {seconds:.1f} s ({len(resolved)} packages, {human(meta['size_bytes'])})")


def check_as_job(env: Path, hash_: str) -> None:
    """The built environment's Python, run as a job uid in a sandbox (agent/sandbox.py): one
    that fails is never kept, so no later job is given it from the cache."""
    from agent import reach, sandbox

    python = str(env / "bin" / "python")
    code, output = sandbox.try_as_job([python, "-c", sandbox.PYTHON_PROBE], reach.prefix_roots(str(env)))
    if code != 0:
        tail = " ".join(output.split())[-300:] or f"exit code {code}"
        raise BuildFailed(
            f"environment {hash_[:12]} was built, but a job's uid cannot run its Python on this node: {tail}; "
            "the operator sets HANGAR_ENV_PYTHONS to an interpreter job uids can run",
            FailureClass.INFRA,
        )


def run_uv(store: Cache, args: list[str], say: SAY, still_current, stdin: str | None = None) -> str:
    """Run uv (umask 022: what it writes is readable by job uids); its stderr goes into the job's
    log line by line. Stopped when the attempt ends; BuildFailed with the resolver's message."""
    store.dir("uv")
    proc = subprocess.Popen(
        [uv_binary(settings.HANGAR_UV), *args],
        cwd=store.root,
        env=uv_env(store.root),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: a stop kills uv and what it started
        preexec_fn=uv_preexec,
    )
    errors: list[str] = []
    out: list[str] = []
    readers = [
        threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True),
        threading.Thread(target=relay, args=(proc.stderr, say, errors), daemon=True),
    ]
    for reader in readers:
        reader.start()
    if stdin is not None:
        proc.stdin.write(stdin + "\n")
    proc.stdin.close()
    deadline = time.monotonic() + settings.HANGAR_ENV_BUILD_TIMEOUT_SECONDS
    while proc.poll() is None:
        try:
            proc.wait(timeout=POLL_SECONDS * 2)
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None and (not still_current() or time.monotonic() > deadline):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if time.monotonic() > deadline:
                limit = settings.HANGAR_ENV_BUILD_TIMEOUT_SECONDS
                raise BuildFailed(
                    f"environment build failed: it took over {limit:g} s (HANGAR_ENV_BUILD_TIMEOUT_SECONDS)"
                )
            raise Stopped()
    for reader in readers:
        reader.join(timeout=5)
    if proc.returncode != 0:
        raise BuildFailed(failure_reason("\n".join(errors)))
    return "".join(out)


def uv_preexec() -> None:
    """uv dies with the runner's thread (a killed agent leaves no build running on), and what it
    writes is readable by job uids (Hangar's own umask is 077)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.umask(0o022)


def relay(stream, say: SAY, errors: list[str]) -> None:
    for line in stream:
        line = _ANSI.sub("", line.rstrip())
        if line:
            errors.append(line)
            say(f"uv: {line}")


def tree_size(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def evict(store: Cache, keep: set[str]) -> list[str]:
    """Past HANGAR_ENV_CACHE_GB, remove least recently used environments no job holds."""
    gone = []
    for hash_ in choose_evictions(store.entries(), settings.HANGAR_ENV_CACHE_GB * 1e9, keep):
        if drop(store, hash_):  # one a running job holds is kept
            gone.append(hash_)
            log.info("environment %s evicted (HANGAR_ENV_CACHE_GB=%s)", hash_[:12], settings.HANGAR_ENV_CACHE_GB)
    return gone


# --- what the node reports ----------------------------------------------------------------------

_reported: dict[int, tuple] = {}  # node id -> what was last written for it


def report(node) -> None:
    """The node's cached environments, for its page and the scheduler's affinity: read from
    the cache each heartbeat (a few small files), written only when something changed."""
    from datetime import UTC, datetime

    from fleet.models import CachedEnvironment

    try:
        store = cache()
        if (now := time.monotonic()) >= _rebuilds_due.get(node.pk, 0.0):  # a query: not every heartbeat
            _rebuilds_due[node.pk] = now + REBUILD_CHECK_SECONDS
            apply_rebuilds(store)
        entries, keys = store.entries(), keys_by_hash(store)
        seen = (tuple(sorted((e.hash, e.last_used) for e in entries)), tuple(sorted(keys.items())))
        if _reported.get(node.pk) == seen:
            return
        rows = []
        for entry in entries:
            meta = store.meta(entry.hash)
            built = meta.get("built_at")
            rows.append({
                "hash": entry.hash, "keys": keys.get(entry.hash, []), "python": meta.get("python", ""),
                "packages": len(meta.get("packages", [])), "size_bytes": entry.size_bytes,
                "built_at": datetime.fromisoformat(built) if built else None,
                "build_seconds": meta.get("build_seconds") or 0.0,
                "last_used_at": datetime.fromtimestamp(entry.last_used, UTC), "jobs": jobs_of(store, entry.hash),
            })  # fmt: skip
        CachedEnvironment.report(node, rows)
        _reported[node.pk] = seen
    except Exception:  # the heartbeat goes on without it
        log.exception("node %s: cached environments not reported", node.name)


REBUILD_WINDOW_DAYS = 7  # requests older than this were applied by every node that was up
REBUILD_CHECK_SECONDS = 30.0  # how often a node looks for requests (and retries one a job held)
_rebuilds_due: dict[int, float] = {}  # node id -> when it next looks


def apply_rebuilds(store: Cache) -> list[str]:
    """Drop the environments an operator asked to rebuild (jobs EnvironmentRebuild) that this
    node built before the request; one a running job holds waits for the next look."""
    from datetime import datetime, timedelta

    from jobs.models import EnvironmentRebuild

    entries = store.entries()
    if not entries:
        return []
    since = timezone.now() - timedelta(days=REBUILD_WINDOW_DAYS)
    requests = list(EnvironmentRebuild.objects.filter(requested_at__gte=since))
    gone = []
    for entry in entries:
        meta = store.meta(entry.hash)
        built = datetime.fromisoformat(meta["built_at"]) if meta.get("built_at") else None
        if any(r.covers(meta.get("environment", ""), entry.hash, built) for r in requests) and drop(store, entry.hash):
            gone.append(entry.hash)
            log.info("environment %s dropped: an operator asked for it to be rebuilt", entry.hash[:12])
    return gone


def drop(store: Cache, hash_: str) -> bool:
    """Remove one environment unless a job holds it (its shared lock)."""
    fd = store.lock(hash_)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        if store.complete(hash_):
            store.remove(hash_)
            return True
        return False
    finally:
        os.close(fd)


def keys_by_hash(store: Cache) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    folder = store.root / "keys"
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not path.name.startswith("."):
            try:
                out.setdefault(path.read_text().strip(), []).append(path.name)
            except OSError:
                pass
    return out


def jobs_of(store: Cache, hash_: str) -> int:
    try:
        return len(set((store.root / "usage" / hash_).read_text().split()))
    except OSError:
        return 0
