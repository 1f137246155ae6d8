"""Code snapshots on the server: receiving one, checking it, retention.

`hangar submit --code DIR` packs DIR into a tar.gz, asks whether the project already has
its sha256 (`GET /api/v1/projects/<slug>/snapshots/<sha256>/`) and uploads it only when
not (`PUT` to the same address). `receive` reads the body once, hashing it as it goes,
refuses a body whose hash is not the one named, then reads the tarball through and refuses
any member that would unpack outside its directory (an absolute path, `..`, a link
pointing out, a hard link), that is not a file, directory or symlink (devices, fifos), or
that brings the files past HANGAR_SNAPSHOT_MAX_MB / HANGAR_SNAPSHOT_MAX_FILES. Only then
is anything stored: a refused upload leaves no row.

The checks of a member are a plain function (`member_problem`); the agent unpacks with
tarfile's `data` filter on top (agent/snapshots.py).
"""

import hashlib
import logging
import posixpath
import re
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction

from jobs.models import Snapshot, SnapshotChunk
from portal import bodylimits

log = logging.getLogger("hangar.scheduler")

SHA256 = re.compile(r"^[0-9a-f]{64}$")
CHUNK_BYTES = 4 * 1024 * 1024  # one database row of a stored snapshot
READ_BYTES = 256 * 1024
RETENTION_INTERVAL_SECONDS = 3600.0


class SnapshotRefused(Exception):
    """A snapshot refused: `field` and `message` as the API's one error shape says them."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(message)
        self.field, self.message, self.status = field, message, status


@dataclass
class Contents:
    files: int = 0
    size: int = 0


def max_bytes() -> int:
    return settings.HANGAR_SNAPSHOT_MAX_MB * 1024 * 1024


def max_upload_bytes() -> int:
    """The largest body a snapshot upload may send (checked before it is read, too)."""
    return bodylimits.snapshot_upload_limit()


def check_sha256(value: str) -> str:
    if not SHA256.match(value or ""):
        raise SnapshotRefused("sha256", f"{value[:80]!r} is not a sha256: give 64 lowercase hex digits")
    return value


def member_problem(name: str, kind: str, linkname: str = "") -> str | None:
    """Why a tar member may not be unpacked into a snapshot's directory (None: it may).
    `kind`: file, dir, symlink, hardlink or other (devices, fifos). A symlink's target is
    checked against the other links too, by `link_escapes`."""
    where = f"member {name[:200]!r}"
    if not name or name.startswith("/"):
        return f"{where} has an absolute path; a snapshot's paths are relative to its directory"
    if ".." in name.split("/"):
        return f"{where} would unpack outside its directory (..)"
    if kind == "hardlink":
        return f"{where} is a hard link; pack regular files"
    if kind == "other":
        return f"{where} is a device, fifo or other special file; pack regular files, directories and symlinks"
    if kind == "symlink" and (not linkname or linkname.startswith("/") or "\0" in linkname):
        return f"{where} is a symlink to {linkname[:200]!r}, outside the snapshot's directory"
    return None


def parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def link_escapes(name: str, links: dict[str, str], max_hops: int = 40) -> bool:
    """Whether the symlink `name` resolves outside the snapshot's directory, following the
    snapshot's other symlinks as a file system would (`q -> .` then `k -> q/..` escapes,
    though each looks harmless alone). A loop counts as escaping."""
    resolved = parts(posixpath.dirname(name))  # no member lies under a symlink (checked)
    todo = parts(links[name])[::-1]
    hops = 0
    while todo:
        part = todo.pop()
        if part == "..":
            if not resolved:
                return True
            resolved.pop()
            continue
        here = "/".join([*resolved, part])
        if here not in links:
            resolved.append(part)
            continue
        hops += 1
        if hops > max_hops or links[here].startswith("/"):
            return True
        todo.extend(parts(links[here])[::-1])  # relative to the link's own directory: `resolved`
    return False


def kind_of(member: tarfile.TarInfo) -> str:
    if member.isreg():
        return "file"
    if member.isdir():
        return "dir"
    if member.issym():
        return "symlink"
    if member.islnk():
        return "hardlink"
    return "other"


def check_tarball(fileobj, limit_bytes: int, limit_files: int) -> Contents:
    """Read the tar.gz through (streaming), refusing the first member that may not be
    unpacked; then the links that resolve outside and the members that lie under a link."""
    contents, links, names = Contents(), {}, []
    try:
        with tarfile.open(fileobj=fileobj, mode="r|gz") as tar:
            for member in tar:
                check_member(member, contents, limit_bytes, limit_files)
                name = "/".join(parts(member.name))
                names.append(name)
                if member.issym():
                    links[name] = member.linkname
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise SnapshotRefused("body", f"is not a readable tar.gz ({exc}); send what `hangar submit --code` packs")
    for name in names:
        above = next((p for p in ancestors(name) if p in links), None)
        if above is not None:
            raise SnapshotRefused("body", f"member {name[:200]!r} lies under the symlink {above!r}; pack real paths")
    for name in links:
        if link_escapes(name, links):
            raise SnapshotRefused(
                "body", f"member {name[:200]!r} is a symlink to {links[name][:200]!r}, outside the snapshot's directory"
            )
    return contents


def check_member(member: tarfile.TarInfo, contents: Contents, limit_bytes: int, limit_files: int) -> None:
    if problem := member_problem(member.name, kind_of(member), member.linkname):
        raise SnapshotRefused("body", problem)
    contents.files += 1
    contents.size += member.size if member.isreg() else 0
    if contents.size > limit_bytes:
        mb = limit_bytes / 1024 / 1024
        raise SnapshotRefused("body", f"its files unpack to more than {mb:g} MB (HANGAR_SNAPSHOT_MAX_MB)", 413)
    if contents.files > limit_files:
        raise SnapshotRefused("body", f"it has more than {limit_files} files (HANGAR_SNAPSHOT_MAX_FILES)", 413)


def ancestors(name: str) -> list[str]:
    pieces = name.split("/")
    return ["/".join(pieces[:i]) for i in range(1, len(pieces))]


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
