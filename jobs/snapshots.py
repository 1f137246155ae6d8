"""Code snapshots on the server: receiving one, checking it, retention.

`hangar submit --code DIR` packs DIR into a tar.gz, asks whether the project already has
its sha256 (`GET /api/v1/projects/<slug>/snapshots/<sha256>/`) and uploads it only when
not (`PUT` to the same address). `receive` reads the body once, hashing it as it goes,
refuses a body whose hash is not the one named, then reads the tarball through within
fixed bounds (hangar/tarballs.py: inflated bytes and header sizes capped before tarfile
parses anything) and refuses any member that would unpack outside its directory (an
absolute path, `..`, a link pointing out, a hard link), that is not a file, directory or
symlink (devices, fifos), or that brings the files past HANGAR_SNAPSHOT_MAX_MB /
HANGAR_SNAPSHOT_MAX_FILES. Only then is anything stored: a refused upload leaves no row.
The agent checks again with the same code before it unpacks (agent/snapshots.py).
"""

import hashlib
import logging
import re
import tempfile
import time

from django.conf import settings
from django.db import IntegrityError, transaction

from hangar.tarballs import Contents, SnapshotRefused, check_tarball
from jobs.models import Snapshot, SnapshotChunk
from portal import bodylimits

log = logging.getLogger("hangar.scheduler")

SHA256 = re.compile(r"^[0-9a-f]{64}$")
CHUNK_BYTES = 4 * 1024 * 1024  # one database row of a stored snapshot
READ_BYTES = 256 * 1024
RETENTION_INTERVAL_SECONDS = 3600.0


def max_bytes() -> int:
    return settings.HANGAR_SNAPSHOT_MAX_MB * 1024 * 1024


def max_upload_bytes() -> int:
    """The largest body a snapshot upload may send (checked before it is read, too)."""
    return bodylimits.snapshot_upload_limit()


def check_sha256(value: str) -> str:
    if not SHA256.match(value or ""):
        raise SnapshotRefused("sha256", f"{value[:80]!r} is not a sha256: give 64 lowercase hex digits")
    return value


def spool(stream, expected: str, length: int) -> tempfile.SpooledTemporaryFile:
    """The body in a temporary file, its sha256 checked against the one named."""
    digest = hashlib.sha256()
    body = tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024)
    left = length
    while left > 0:
        piece = stream.read(min(READ_BYTES, left))
        if not piece:
            body.close()
            raise SnapshotRefused("body", f"ended after {length - left} of the {length} bytes announced")
        digest.update(piece)
        body.write(piece)
        left -= len(piece)
    if digest.hexdigest() != expected:
        body.close()
        raise SnapshotRefused(
            "sha256", f"the body's sha256 is {digest.hexdigest()}, not {expected}: name the hash of what you send"
        )
    body.seek(0)
    return body


def receive(project, sha256: str, stream, length: int | None, user) -> tuple[Snapshot, bool]:
    """Store the tar.gz in `stream` as `project`'s snapshot `sha256`; (snapshot, created).
    An existing snapshot is returned as is (its body is not read)."""
    check_sha256(sha256)
    existing = Snapshot.objects.filter(project=project, sha256=sha256).first()
    if existing is not None:
        existing.touch()
        return existing, False
    if not length:
        status = 411 if length is None else 400
        raise SnapshotRefused("body", "is empty: send the tar.gz with its Content-Length", status)
    if length > max_upload_bytes():
        raise SnapshotRefused("body", f"is {length} bytes; at most {max_upload_bytes()} are accepted", 413)
    with spool(stream, sha256, length) as body:
        contents = check_tarball(body, max_bytes(), settings.HANGAR_SNAPSHOT_MAX_FILES)
        body.seek(0)
        try:
            return store(project, sha256, length, contents, body, user), True
        except IntegrityError:  # the same snapshot uploaded twice at once: the other one is it
            return Snapshot.objects.get(project=project, sha256=sha256), False


def store(project, sha256: str, size: int, contents: Contents, body, user) -> Snapshot:
    with transaction.atomic():
        snapshot = Snapshot.objects.create(
            project=project,
            sha256=sha256,
            size=size,
            unpacked_size=contents.size,
            files=contents.files,
            created_by=user,
        )
        index = 0
        while piece := body.read(CHUNK_BYTES):
            SnapshotChunk.objects.create(snapshot=snapshot, index=index, data=piece)
            index += 1
    return snapshot


def for_submit(project, code: dict | None) -> tuple[Snapshot | None, dict, str]:
    """The snapshot a submit names in `code` (its spec's field), the facts to keep on the
    job, and the diff (capped). Refused when the project has no such snapshot."""
    from rest_framework.exceptions import ValidationError

    if not code:
        return None, {}, ""
    sha = code["snapshot"]
    snapshot = Snapshot.objects.filter(project=project, sha256=sha).first()
    if snapshot is None:
        raise ValidationError(
            {
                "code.snapshot": f"project {project.slug} has no snapshot {sha}; upload it first "
                f"(PUT /api/v1/projects/{project.slug}/snapshots/{sha}/ with the tar.gz; `hangar submit --code DIR` "
                "does both), or submit again with --code if retention removed it"
            }
        )
    diff, cap = code.get("diff") or "", settings.HANGAR_SNAPSHOT_DIFF_MAX_BYTES
    truncated = bool(code.get("diff_truncated"))
    if len(diff.encode()) > cap:
        diff, truncated = diff.encode()[:cap].decode(errors="ignore"), True
    facts = {"snapshot": sha, "size": snapshot.size, "files": snapshot.files}
    facts.update({k: code[k] for k in ("commit", "branch", "dirty") if k in code})
    facts["diff_truncated"] = truncated
    return snapshot, facts, diff


def version_of(facts: dict) -> str:
    """A code_version for a job that gave none: its commit (and whether the tree was dirty)."""
    commit = facts.get("commit") or ""
    return f"{commit}{'+dirty' if facts.get('dirty') else ''}" if commit else ""


_next_run = 0.0


def enforce_retention_if_due() -> int:
    """Delete snapshots no job has named for HANGAR_SNAPSHOT_RETENTION_DAYS, once an hour
    (the scheduler's periodic loop; as jobs/logretention.py does for log lines)."""
    global _next_run
    now = time.monotonic()
    if now < _next_run:
        return 0
    _next_run = now + RETENTION_INTERVAL_SECONDS
    deleted = Snapshot.delete_expired(settings.HANGAR_SNAPSHOT_RETENTION_DAYS)
    if deleted:
        days = settings.HANGAR_SNAPSHOT_RETENTION_DAYS
        log.info("snapshot retention: deleted %d snapshots no job named for %g days", deleted, days)
    return deleted
