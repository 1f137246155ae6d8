"""A job's code snapshot on this node: fetched once per hash, unpacked into the agent's
cache, and copied fresh for every rank of every attempt (jobs/snapshots.py stores them).

The agent reaches the portal only through the database (it holds no API token), so it
reads the snapshot's chunks from there, checks their sha256 and the tarball's members
again (jobs/snapshots.check_tarball), and unpacks with tarfile's `data` filter into a
temporary directory that is renamed into place: a cache entry is whole or absent, and two
ranks unpacking the same hash at once leave one. HANGAR_SNAPSHOT_CACHE_DIR lies under the
data directory, out of every sandbox's sight.
"""

import hashlib
import os
import shutil
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from django.conf import settings

from jobs import snapshots
from jobs.models import Snapshot

_unpacking = threading.Lock()  # ranks of one agent unpack one at a time; other agents race safely by rename
IN_USE_SECONDS = 600  # a cache entry used this recently may still be being copied: never evicted


class CodeUnavailable(Exception):
    """The job's snapshot is gone from the database (retention): no attempt can run it."""


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
            unpack(tarball, tree)
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
        raise OSError(f"code snapshot {snapshot.sha256} reads back as {digest.hexdigest()}: stored chunks damaged")


def unpack(tarball: Path, tree: Path) -> None:
    with tarball.open("rb") as raw:
        try:
            snapshots.check_tarball(raw, snapshots.max_bytes(), settings.HANGAR_SNAPSHOT_MAX_FILES)
        except snapshots.SnapshotRefused as refused:
            raise OSError(f"code snapshot refused on unpacking: {refused.message}")
    tree.mkdir()
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            tar.extractall(tree, filter="data")
    except tarfile.TarError as exc:
        raise OSError(f"code snapshot refused on unpacking: {exc}")


def fresh_copy(job, workdir: Path) -> None:
    """`workdir` as a fresh copy of the job's snapshot: nothing an earlier attempt wrote is left."""
    source = cached(job.code["snapshot"], job.snapshot_id)
    if workdir.exists() or workdir.is_symlink():
        shutil.rmtree(workdir)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(workdir.parent, 0o711)  # job uids pass through to their own copy, never list the others
    shutil.copytree(source, workdir, symlinks=True)


def remove_copy(workdir: Path) -> None:
    """A rank's copy once its processes are gone: a node keeps only the copies of running ranks."""
    shutil.rmtree(workdir, ignore_errors=True)
