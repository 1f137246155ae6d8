"""Reading a code snapshot's tar.gz within fixed bounds: the portal checks an upload with it
(jobs/snapshots.py), the agent checks and unpacks it again (agent/snapshots.py), and `hangar
code` unpacks with it (hangar/snapshots.py). Standard library only: the client shares it.

tarfile reads a GNU long-name or long-link header and a pax header whole into memory, and
an unbounded inflate can make a 783 KB upload hold a 768 MiB "name". So the gzip stream is
inflated in bounded reads, refused past a byte limit (`Guarded`), and every header block
passes `HeaderWalk` before tarfile reads it, at the offsets where tarfile will read it: an
extension header over MAX_HEADER_BYTES, a sparse or unknown member type, and a pax record
that would move tarfile's offsets (`size`, `GNU.sparse.*`) are refused there. The members
tarfile then reads are checked (`member_problem`, `check_tree`), and `extract` writes them
itself: it needs no extraction filter, which tarfile has only from Python 3.11.4.
"""

import gzip
import os
import posixpath
import shutil
import tarfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

BLOCK = tarfile.BLOCKSIZE
MAX_HEADER_BYTES = 8 * 1024  # a long name or link, or a pax header: a path is at most 4096 bytes
MAX_EXTENSIONS = 4  # extension headers before one member: GNU long name and link, pax, global pax
HEADER_BYTES_PER_FILE = 2048  # what a member adds to the tar stream: its header, padding, a pax header
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255  # one path component (NAME_MAX): a longer one cannot be written
MAX_EXTENSION_BYTES = 32 * 1024 * 1024  # long names and pax headers in all: names are held in memory
MAX_RESOLVE_STEPS = 1_000_000  # path components walked to resolve all of a snapshot's symlinks
READ_BYTES = 256 * 1024  # what tarfile reads at a time (its bufsize), inflated
WITH_DATA = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
WITHOUT_DATA = (tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.DIRTYPE, tarfile.FIFOTYPE)
EXTENSIONS = {
    tarfile.GNUTYPE_LONGNAME: "GNU long name",
    tarfile.GNUTYPE_LONGLINK: "GNU long link",
    tarfile.XHDTYPE: "pax header",
    tarfile.XGLTYPE: "pax global header",
}
PAX = (tarfile.XHDTYPE, tarfile.XGLTYPE)
HIGH_BYTES = bytes(range(128, 256))
NOT_READABLE = "send what `hangar submit --code` packs"


class SnapshotRefused(Exception):
    """A snapshot refused: `field` and `message` as the API's one error shape says them."""

    def __init__(self, field: str, message: str, status: int = 400):
        super().__init__(message)
        self.field, self.message, self.status = field, message, status


@dataclass
class Contents:
    files: int = 0
    size: int = 0
    kinds: dict[str, str] = field(default_factory=dict)  # each member's path and kind (`kind_of`)


def stream_limit(limit_bytes: int, limit_files: int) -> int:
    """The most bytes a snapshot's tar stream may inflate to: its files and their headers."""
    return limit_bytes + limit_files * HEADER_BYTES_PER_FILE + tarfile.RECORDSIZE


def block_size(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def mib(size: int) -> str:
    return f"{size / 1024 / 1024:.0f} MiB" if size >= 1024 * 1024 else f"{size} bytes"


# --- inflating, header by header ---------------------------------------------------------------


class HeaderWalk:
    """Reads each tar header block as the stream passes, at the offset where tarfile will read
    it (after the data of the member before), and refuses what tarfile would read unbounded."""

    def __init__(self):
        self.skip = 0  # data bytes to pass before the next block to read
        self.want = BLOCK  # bytes to gather: a header block, or a pax header's records
        self.gathered = bytearray()
        self.pax = False  # gathering a pax header's records, not a header
        self.extensions = 0  # extension headers since the last member
        self.extension_bytes = 0  # in all: what tarfile keeps of them (names) is held in memory
        self.ended = False  # past the first zero block: tarfile reads no further header

    def feed(self, data: bytes) -> None:
        view, at = memoryview(data), 0
        while at < len(view) and not self.ended:
            if self.skip:
                step = min(self.skip, len(view) - at)
                self.skip, at = self.skip - step, at + step
                continue
            step = min(self.want - len(self.gathered), len(view) - at)
            self.gathered += view[at : at + step]
            at += step
            if len(self.gathered) == self.want:
                block = bytes(self.gathered)
                self.gathered.clear()
                if self.pax:
                    self.records(block)
                else:
                    self.header(block)

    def header(self, block: bytes) -> None:
        if block.count(0) == BLOCK:
            self.ended = True  # tarfile ends the archive at the first zero block
            return
        size, checksum = octal(block[124:136]), octal(block[148:156])
        if size is None or checksum is None:
            raise refused("a tar header has a field that is not a number")
        if checksum not in checksums(block):
            raise refused("a tar header is damaged (its checksum)")
        kind = block[156:157]
        if kind in EXTENSIONS:
            self.extension(kind, size)
        else:
            self.member(kind, block, size)

    def member(self, kind: bytes, block: bytes, size: int) -> None:
        self.extensions = 0
        if kind == tarfile.AREGTYPE and block[:100].split(b"\0", 1)[0].endswith(b"/"):
            kind = tarfile.DIRTYPE  # as tarfile reads an old-style directory: no data follows
        if kind in WITH_DATA:
            self.skip = block_size(size)
        elif kind not in WITHOUT_DATA:
            raise refused(
                f"a tar member has type {kind.decode('latin-1')!r} (sparse, multi-volume or unknown); "
                "pack regular files, directories and symlinks"
            )

    def extension(self, kind: bytes, size: int) -> None:
        self.extensions += 1
        if self.extensions > MAX_EXTENSIONS:
            raise refused(f"a tar member has more than {MAX_EXTENSIONS} extension headers")
        if size > MAX_HEADER_BYTES:
            raise refused(
                f"a tar {EXTENSIONS[kind]} holds {size} bytes ({mib(size)}); at most {MAX_HEADER_BYTES} are "
                "accepted (a path is at most 4096 bytes)"
            )
        self.extension_bytes += size
        if self.extension_bytes > MAX_EXTENSION_BYTES:
            raise refused(f"its tar headers (long names, pax) hold more than {mib(MAX_EXTENSION_BYTES)} in all")
        if kind in PAX and size:
            self.pax, self.want = True, block_size(size)
        else:
            self.skip = block_size(size)

    def records(self, data: bytes) -> None:
        # tarfile parses the padding after the records too; a byte search cannot miss a record.
        if b" size=" in data or b"GNU.sparse" in data:
            raise refused("a tar pax header sets a member's size or sparse map; pack regular files")
        self.pax, self.want = False, BLOCK


def octal(field: bytes) -> int | None:
    """A header's number as tarfile reads it: octal digits, ended by NUL or space. None for
    anything else, base-256 too (GNU's for files over 8 GiB: no snapshot member is)."""
    digits = field.split(b"\0", 1)[0].strip()
    if digits.strip(b"01234567"):
        return None
    return int(digits or b"0", 8)


def checksums(block: bytes) -> tuple[int, int]:
    """A header's checksum as writers sum it, unsigned or signed (old tars), the checksum field
    itself counted as eight spaces; tarfile accepts either."""
    rest = block[:148] + block[156:]
    unsigned = 256 + sum(rest)
    return unsigned, unsigned - 256 * (len(rest) - len(rest.translate(None, HIGH_BYTES)))


def refused(problem: str) -> SnapshotRefused:
    return SnapshotRefused("body", f"{problem}; {NOT_READABLE}")


class Guarded:
    """What tarfile reads: the tar stream inside the gzip file (read in bounded pieces, so it
    never inflates more than asked), refused past `limit` bytes, each header walked first."""

    def __init__(self, raw, limit: int):
        self.inflated, self.limit, self.out = gzip.GzipFile(fileobj=raw, mode="rb"), limit, 0
        self.walk = HeaderWalk()

    def read(self, size: int = -1) -> bytes:
        data = self.inflated.read(size if size is not None and size > 0 else READ_BYTES)
        self.out += len(data)
        if self.out > self.limit:
            raise SnapshotRefused(
                "body",
                f"it inflates to more than {mib(self.limit)} of tar: its files' bytes (HANGAR_SNAPSHOT_MAX_MB) "
                f"and {HEADER_BYTES_PER_FILE} bytes of headers per file (HANGAR_SNAPSHOT_MAX_FILES)",
                413,
            )
        self.walk.feed(data)
        return data


@contextmanager
def opened(raw, limit: int) -> Iterator[tarfile.TarFile]:
    """The tar.gz in `raw` as a tarfile stream (members in order, read once), its problems as
    SnapshotRefused."""
    try:
        with tarfile.open(fileobj=Guarded(raw, limit), mode="r|", bufsize=READ_BYTES) as tar:
            yield tar
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise SnapshotRefused("body", f"is not a readable tar.gz ({exc}); {NOT_READABLE}")


# --- the members --------------------------------------------------------------------------------


def member_problem(name: str, kind: str, linkname: str = "") -> str | None:
    """Why a tar member may not be unpacked into a snapshot's directory (None: it may).
    `kind`: file, dir, symlink, hardlink or other (devices, fifos). A symlink's target is
    checked against the other links too, by `check_tree`."""
    where = f"member {name[:200]!r}"
    if not name or name.startswith("/"):
        return f"{where} has an absolute path; a snapshot's paths are relative to its directory"
    if "\0" in name:
        return f"{where} has a NUL byte in its path"
    if ".." in name.split("/"):
        return f"{where} would unpack outside its directory (..)"
    if kind == "hardlink":
        return f"{where} is a hard link; pack regular files"
    if kind == "other":
        return f"{where} is a device, fifo or other special file; pack regular files, directories and symlinks"
    if kind == "symlink" and (not linkname or linkname.startswith("/") or "\0" in linkname):
        return f"{where} is a symlink to {linkname[:200]!r}, outside the snapshot's directory"
    if not parts(name) and kind != "dir":
        return f"{where} names the snapshot's directory itself; give it a name"
    return length_problem(where, name, linkname)


def length_problem(where: str, name: str, linkname: str) -> str | None:
    encoded = "/".join(parts(name)).encode("utf-8", "surrogateescape")
    if len(encoded) > MAX_PATH_BYTES or max(map(len, encoded.split(b"/"))) > MAX_NAME_BYTES:
        limits = f"{MAX_NAME_BYTES} bytes a name, {MAX_PATH_BYTES} in all"
        return f"{where} has a path longer than a file system takes ({limits})"
    if len(linkname.encode("utf-8", "surrogateescape")) >= MAX_PATH_BYTES:
        return f"{where} is a symlink whose target is longer than {MAX_PATH_BYTES - 1} bytes"
    return None


def parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


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


def check_tarball(raw, limit_bytes: int, limit_files: int) -> Contents:
    """Read the tar.gz through (streaming, within `stream_limit`), refusing the first member
    that may not be unpacked; then the members that lie under a link or a file, and the
    links that resolve outside (`check_tree`)."""
    contents = Contents()
    with opened(raw, stream_limit(limit_bytes, limit_files)) as tar:
        links = {}
        for member in tar:
            name = check_member(member, contents, limit_bytes, limit_files)
            if member.issym():
                links[name] = member.linkname
    check_tree(contents.kinds, links)
    return contents


def check_member(member: tarfile.TarInfo, contents: Contents, limit_bytes: int, limit_files: int) -> str:
    """The member's path, once it is known to be one that may be unpacked; counted."""
    kind = kind_of(member)
    if problem := member_problem(member.name, kind, member.linkname):
        raise SnapshotRefused("body", problem)
    name = "/".join(parts(member.name))
    if name in contents.kinds:
        raise SnapshotRefused("body", f"member {name[:200]!r} appears twice; pack each path once")
    contents.kinds[name] = kind
    contents.files += 1
    contents.size += member.size if kind == "file" else 0
    if contents.size > limit_bytes:
        mb = limit_bytes / 1024 / 1024
        raise SnapshotRefused("body", f"its files unpack to more than {mb:g} MB (HANGAR_SNAPSHOT_MAX_MB)", 413)
    if contents.files > limit_files:
        raise SnapshotRefused("body", f"it has more than {limit_files} files (HANGAR_SNAPSHOT_MAX_FILES)", 413)
    return name


class Node:
    """A path of the snapshot as a tree: a member's kind (an implicit directory is a "dir")."""

    __slots__ = ("kind", "link", "children")

    def __init__(self, kind: str = "dir", link: str = ""):
        self.kind, self.link, self.children = kind, link, {}


def check_tree(kinds: dict[str, str], links: dict[str, str]) -> None:
    """Refuse a member that lies under a file or a symlink, and a symlink that resolves
    outside. The paths go into a tree once, so the work grows with their length, not its
    square, and resolving all the links has one budget of steps."""
    root = Node()
    for name, kind in kinds.items():
        place(root, name, kind, links.get(name, ""))
    budget = [MAX_RESOLVE_STEPS]
    for name, target in links.items():
        if escapes(root, name, target, budget):
            raise SnapshotRefused(
                "body", f"member {name[:200]!r} is a symlink to {target[:200]!r}, outside the snapshot's directory"
            )


def place(root: Node, name: str, kind: str, link: str) -> None:
    pieces = name.split("/") if name else []
    node = root
    for depth, piece in enumerate(pieces):
        if node.kind != "dir":
            raise under(name, "/".join(pieces[:depth]), node.kind)
        child = node.children.get(piece)
        if child is None:
            child = node.children[piece] = Node()
        node = child
    if kind != "dir" and node.children:  # placed after what lies under it
        below = next(iter(node.children))
        raise under(f"{name}/{below}", name, kind)
    node.kind, node.link = kind, link


def under(name: str, above: str, kind: str) -> SnapshotRefused:
    if kind == "symlink":
        return SnapshotRefused("body", f"member {name[:200]!r} lies under the symlink {above[:200]!r}; pack real paths")
    return SnapshotRefused("body", f"member {name[:200]!r} lies under {above[:200]!r}, which is not a directory")


def escapes(root: Node, name: str, target: str, budget: list[int], max_hops: int = 40) -> bool:
    """Whether the symlink `name` resolves outside the snapshot's directory, following the
    snapshot's other symlinks as a file system would (`q -> .` then `k -> q/..` escapes,
    though each looks harmless alone). A loop counts as escaping."""
    trail = [root]  # the directories from the root to where resolution stands
    for piece in parts(posixpath.dirname(name)):
        trail.append(trail[-1].children[piece])
    todo, hops = parts(target)[::-1], 0
    while todo:
        budget[0] -= 1
        if budget[0] < 0:
            raise SnapshotRefused("body", f"its symlinks take more than {MAX_RESOLVE_STEPS} steps to resolve")
        part = todo.pop()
        if part == "..":
            if len(trail) == 1:
                return True
            trail.pop()
            continue
        child = trail[-1].children.get(part) or Node()  # a path the snapshot lacks: dangling, not out
        if child.kind != "symlink":
            trail.append(child)
            continue
        hops += 1
        if hops > max_hops or child.link.startswith("/"):
            return True
        todo.extend(parts(child.link)[::-1])  # relative to the link's own directory: where `trail` ends
    return False


# --- unpacking ---------------------------------------------------------------------------------


def extract(raw, tree: Path, contents: Contents, limit: int) -> int:
    """Write the members `check_tarball` accepted (`contents`) into the empty directory `tree`:
    regular files 0644 or 0755, directories 0755, symlinks as they are; no owners, times or
    set-id bits from the tarball. The number of members written."""
    tree.mkdir(mode=0o755, parents=True, exist_ok=True)
    written = 0
    with opened(raw, limit) as tar:
        for member in tar:
            name = "/".join(parts(member.name))
            kind = kind_of(member)
            if contents.kinds.get(name) != kind:
                raise SnapshotRefused("body", f"member {name[:200]!r} was not in the tarball as checked")
            write(tar, member, tree, name, kind)
            written += 1
    return written


def write(tar: tarfile.TarFile, member: tarfile.TarInfo, tree: Path, name: str, kind: str) -> None:
    target = tree / name
    if kind == "dir":
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
        os.chmod(target, 0o755)
        return
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if kind == "symlink":
        os.symlink(member.linkname, target)
        return
    mode = 0o755 if member.mode & 0o100 else 0o644
    descriptor = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with open(descriptor, "wb") as out, tar.extractfile(member) as content:
        os.fchmod(descriptor, mode)  # as packed, whatever the umask
        shutil.copyfileobj(content, out, READ_BYTES)
        if out.tell() != member.size:
            raise SnapshotRefused("body", f"member {name[:200]!r} ends before its {member.size} bytes")
