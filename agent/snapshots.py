"""A job's code snapshot on this node: fetched once per hash, unpacked into the agent's
cache, and copied fresh for every rank of every attempt (jobs/snapshots.py stores them).

The agent reaches the portal only through the database (it holds no API token), so it
reads the snapshot's chunks from there, checks their sha256, checks the tarball again and
unpacks it within the same bounds as the portal (hangar/tarballs.py: no extraction filter
needed, so any Python 3.11 does) into a temporary directory that is renamed into place: a
cache entry is whole or absent, and two ranks unpacking the same hash at once leave one.
HANGAR_SNAPSHOT_CACHE_DIR lies under the data directory, out of every sandbox's sight.

What is wrong with the snapshot itself raises CodeUnavailable (CodeRefused: its content):
no node could run it, so the attempt is the user's to fix. An OSError is this node's own
trouble (a full disk, a permission), which another node may not have.
"""

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from django.conf import settings

from agent import sandbox
from hangar import tarballs
from jobs import snapshots
from jobs.models import Snapshot

log = logging.getLogger("hangar.agent")

_unpacking = threading.Lock()  # ranks of one agent unpack one at a time; other agents race safely by rename
IN_USE_SECONDS = 600  # a cache entry used this recently may still be being copied: never evicted


class CodeUnavailable(Exception):
    """The job's snapshot is gone from the database (retention): no attempt can run it."""


class CodeRefused(CodeUnavailable):
    """The job's snapshot cannot be unpacked (refused by the checks, or stored damaged): no
    node can run it; the message says why and to submit the code again."""


def cached(sha256: str, snapshot_id: int | None) -> Path:
    """The unpacked snapshot `sha256` (row `snapshot_id`), fetching and unpacking it first if
    this node has not."""
    root = Path(settings.HANGAR_SNAPSHOT_CACHE_DIR)
    entry = root / sha256
    if entry.is_dir():
        return used(entry)
    with _unpacking:
        if entry.is_dir():
            return used(entry)
        snapshot = Snapshot.objects.filter(pk=snapshot_id, sha256=sha256).first()
        if snapshot is None:
            raise CodeUnavailable(f"code snapshot {sha256} is no longer stored (retention); submit again with --code")
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        with tempfile.TemporaryDirectory(dir=root, prefix=".unpack-") as scratch:
            tarball = Path(scratch) / "code.tar.gz"
            fetch(snapshot, tarball)
            tree = Path(scratch) / "tree"
            unpack(tarball, tree, sha256)
            try:
                tree.rename(entry)
            except OSError:  # another agent on this node renamed its copy first: the same bytes
                if not entry.is_dir():
                    raise
        evict(root, settings.HANGAR_SNAPSHOT_CACHE_ENTRIES)
    return used(entry)


def used(entry: Path) -> Path:
    os.utime(entry)  # the entry's time says when a rank last used it (eviction goes by it)
    return entry


def evict(root: Path, keep: int) -> list[str]:
    """Remove the least recently used entries past `keep`, none used in the last IN_USE_SECONDS."""
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=mtime)
    removed = []
    for entry in entries[: max(0, len(entries) - keep)]:
        if time.time() - mtime(entry) > IN_USE_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def fetch(snapshot: Snapshot, path: Path) -> None:
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for chunk in snapshot.chunks():
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != snapshot.sha256:
        raise CodeRefused(
            f"code snapshot {snapshot.sha256[:12]} reads back as {digest.hexdigest()[:12]}: its stored chunks "
            "are damaged; submit again with --code"
        )


def unpack(tarball: Path, tree: Path, sha256: str) -> int:
    """The tarball checked (hangar/tarballs.py) and written into the new directory `tree`; the
    number of members. CodeRefused names what is wrong with it."""
    limit_bytes, limit_files = snapshots.max_bytes(), settings.HANGAR_SNAPSHOT_MAX_FILES
    try:
        with tarball.open("rb") as raw:
            contents = tarballs.check_tarball(raw, limit_bytes, limit_files)
        # Read twice: a link is known to stay inside only once every member has been seen.
        with tarball.open("rb") as raw:
            return tarballs.extract(raw, tree, contents, tarballs.stream_limit(limit_bytes, limit_files))
    except tarballs.SnapshotRefused as refused:
        raise CodeRefused(
            f"code snapshot {sha256[:12]} cannot be unpacked: {refused.message}. Submit again with "
            "`hangar submit --code DIR`"
        )


def fresh_copy(job, workdir: Path) -> None:
    """`workdir` as a fresh copy of the job's snapshot: nothing an earlier attempt wrote is left."""
    source = cached(job.code["snapshot"], job.snapshot_id)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    sandbox.remove_path(workdir)  # an earlier attempt's, which its uid wrote: by descriptors
    os.chmod(workdir.parent, 0o711)  # job uids pass through to their own copy, never list the others
    # Root copies by path between two directories no job can write: the cache, and the job's
    # directory (its uid is given only the copy, afterwards, and the checkpoints beside it).
    shutil.copytree(source, workdir, symlinks=True)


def remove_copy(workdir: Path) -> None:
    """A rank's copy once its processes are gone: a node keeps only the copies of running ranks.
    What the job wrote there is removed by descriptors (sandbox.remove_tree), never followed."""
    try:
        sandbox.remove_path(workdir)
    except OSError as exc:
        log.warning("the code copy %s was not removed: %s", workdir, exc)
