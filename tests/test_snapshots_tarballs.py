"""Reading a snapshot's tar.gz within bounds (hangar/tarballs.py, which the portal, the
agent and the client share): header bombs built for real and refused before tarfile reads them,
with the reading process's peak memory measured in a process of its own; the inflate cap;
member checks; unpacking without tarfile's extraction filter, under Debian's
/usr/bin/python3 (3.11.2, which has none) when the machine has it."""

import functools
import io
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import pytest

import hangar.tarballs
from hangar.snapshots import SnapshotError, pack, unpack
from hangar.tarballs import SnapshotRefused

BASE_DIR = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
LIMIT, FILES = 100 * MiB, 100_000  # the server's defaults
SYSTEM_PYTHON = "/usr/bin/python3"


@functools.cache
def header_bomb(size: int = 768 * MiB, kind: bytes = tarfile.GNUTYPE_LONGNAME) -> bytes:
    """A tar.gz whose first header (a GNU long name, or a pax header) declares `size` bytes, all
    there (a's), then one real member: ~800 KB that tarfile inflates and holds whole. Built
    from one deflate block repeated (each ends with a full flush, so each is the same bytes)."""
    extension = tarfile.TarInfo("././@LongLink")
    extension.type, extension.size = kind, size
    head = extension.tobuf(format=tarfile.GNU_FORMAT)
    member = tarfile.TarInfo("x")
    member.size = 1
    tail = b"\0" * (-size % 512) + member.tobuf(format=tarfile.GNU_FORMAT) + b"x".ljust(512, b"\0") + b"\0" * 1024
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    chunk = b"a" * MiB
    parts = [deflate.compress(head) + deflate.flush(zlib.Z_FULL_FLUSH)]
    block = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(head)
    for _ in range(size // MiB):
        parts.append(block)
        crc = zlib.crc32(chunk, crc)
    rest = b"a" * (size % MiB) + tail
    parts.append(deflate.compress(rest) + deflate.flush())
    crc = zlib.crc32(rest, crc)
    gzip_head = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return gzip_head + b"".join(parts) + struct.pack("<II", crc, (len(head) + size + len(rest)) & 0xFFFFFFFF)


def tar_gz(*members: tuple[tarfile.TarInfo, bytes], fmt=tarfile.PAX_FORMAT, raw: bytes = b"") -> bytes:
    out = io.BytesIO()  # gzip_bytes, not tarfile's w:gz: no time in the header (the ids of tests made of it)
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for info, payload in members:
            tar.addfile(info, io.BytesIO(payload) if info.isreg() else None)
    if not raw:
        return gzip_bytes(out.getvalue())
    return gzip_bytes(out.getvalue().rstrip(b"\0") + raw)


def gzip_bytes(data: bytes) -> bytes:
    deflate = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return deflate.compress(data) + deflate.flush()


def info(name: str, kind=tarfile.REGTYPE, size: int = 0, link: str = "", mode: int = 0o644, pax=None):
    member = tarfile.TarInfo(name)
    member.type, member.size, member.linkname, member.mode = kind, size, link, mode
    member.pax_headers = pax or {}
    return member


def check(data: bytes, limit: int = LIMIT, files: int = FILES) -> hangar.tarballs.Contents:
    return hangar.tarballs.check_tarball(io.BytesIO(data), limit, files)


# --- header bombs, built for real ------------------------------------------------------------


PEAK = """
import json, sys, time
sys.path.insert(0, {base!r})
from {module} import check_tarball, SnapshotRefused

def peak_mb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) // 1024

before, start = peak_mb(), time.perf_counter()
try:
    with open(sys.argv[1], "rb") as raw:
        contents = check_tarball(raw, {limit}, {files})
    outcome = {{"accepted": contents.files}}
except SnapshotRefused as refused:
    outcome = {{"field": refused.field, "message": refused.message}}
print(json.dumps({{**outcome, "seconds": time.perf_counter() - start, "grew_mb": peak_mb() - before}}))
"""


def checked_in_own_process(python: str, module: str, data: bytes, tmp_path: Path) -> dict:
    """check_tarball of `module` run on `data` in a fresh `python`: what it said, how long it
    took, and how much its peak resident memory (VmHWM) grew."""
    (tmp_path / "body.tar.gz").write_bytes(data)
    script = PEAK.format(base=str(BASE_DIR), module=module, limit=LIMIT, files=FILES)
    done = subprocess.run(
        [python, "-c", script, str(tmp_path / "body.tar.gz")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("module", ["hangar.tarballs"])
@pytest.mark.parametrize(
    "kind, what",
    [(tarfile.GNUTYPE_LONGNAME, "GNU long name"), (tarfile.XHDTYPE, "pax header"), (tarfile.XGLTYPE, "pax global")],
)
def test_a_header_bomb_is_refused_before_it_is_inflated(module, kind, what, tmp_path):
    data = header_bomb(kind=kind)
    assert len(data) < 1024 * 1024  # under a megabyte that tarfile would hold as 768 MiB
    said = checked_in_own_process(sys.executable, module, data, tmp_path)
    assert said["field"] == "body"
    assert f"a tar {what}" in said["message"] and "holds 805306368 bytes (768 MiB)" in said["message"], said
    assert said["grew_mb"] < 20 and said["seconds"] < 1, said


def test_the_bomb_is_what_tarfile_alone_holds_whole(tmp_path):
    """The setup proved: a smaller bomb of the same shape is a valid tar.gz, and tarfile alone
    (what the server ran before) reads its whole long name into memory."""
    data = header_bomb(size=64 * MiB)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|gz") as tar:
        (member,) = list(tar)
    assert len(member.name) == 64 * MiB and member.name[:3] == "aaa"


def test_the_inflated_stream_is_capped_whatever_its_headers_say():
    # Each member brings an 8 KiB pax header (allowed alone): past the 2 KiB a file may add.
    comment = "c" * (hangar.tarballs.MAX_HEADER_BYTES - 100)
    data = tar_gz(*[(info(f"f{i}", size=1, pax={"comment": comment}), b"x") for i in range(40)])
    with pytest.raises(SnapshotRefused) as refused:
        check(data, limit=1000, files=100)
    assert refused.value.status == 413 and "inflates to more than" in refused.value.message
    assert check(data, limit=1000, files=1000).files == 40


@pytest.mark.parametrize(
    "data, problem",
    [
        (tar_gz((info("a", size=1, pax={"size": "1"}), b"x")), "sets a member's size or sparse map"),
        (tar_gz((info("a", size=1, pax={"GNU.sparse.major": "1"}), b"x")), "sets a member's size or sparse map"),
        (tar_gz((info("s", kind=tarfile.GNUTYPE_SPARSE, size=1), b"x"), fmt=tarfile.GNU_FORMAT), "has type 'S'"),
        (tar_gz((info("v", kind=b"V"), b"")), "has type 'V'"),
        (gzip_bytes(b"\x01" * 1024), "a tar header has a field that is not a number"),
        (gzip_bytes(tarfile.TarInfo("a").tobuf().replace(b"a", b"b", 1) + b"\0" * 1024), "a tar header is damaged"),
    ],
    ids=["pax-size", "pax-sparse", "gnu-sparse", "type-V", "not-a-number", "damaged"],
)
def test_headers_that_would_move_tarfiles_offsets_are_refused(data, problem):
    with pytest.raises(SnapshotRefused) as refused:
        check(data)
    assert problem in refused.value.message and refused.value.field == "body"


def test_more_extension_headers_than_a_member_needs_are_refused():
    pax = info("g", kind=tarfile.XGLTYPE, size=0).tobuf(format=tarfile.GNU_FORMAT)
    plain = tarfile.TarInfo("a").tobuf(format=tarfile.GNU_FORMAT)
    with pytest.raises(SnapshotRefused, match="more than 4 extension headers"):
        check(gzip_bytes(pax * 5 + plain + b"\0" * 1024))
    assert check(gzip_bytes(pax * 4 + plain + b"\0" * 1024)).files == 1


def test_a_truncated_or_garbled_gzip_is_not_a_readable_tar_gz():
    good = pack_tree({"train.py": "x" * 5000})
    for data in (good[: len(good) // 2], b"not gzip at all"):
        with pytest.raises(SnapshotRefused) as refused:
            check(data)
        assert refused.value.message.startswith("is not a readable tar.gz (")
    assert check(good).files == 1


# --- members --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "members, problem",
    [
        ([info("a", size=1), info("a", size=1)], "'a' appears twice"),
        ([info("a", size=1), info("a/b", size=1)], "lies under 'a', which is not a directory"),
        ([info(".", size=1)], "names the snapshot's directory itself"),
        ([info("d/" + "n" * 256, size=1)], "has a path longer than a file system takes"),
        ([info("l", kind=tarfile.SYMTYPE, link="x" * 5000)], "whose target is longer than 4095 bytes"),
        ([info("a", size=1, pax={"path": "a\0b"})], "has a NUL byte in its path"),
        ([info("d/x", size=1), info("d", kind=tarfile.SYMTYPE, link="e")], "'d/x' lies under the symlink 'd'"),
    ],
)
def test_members_that_cannot_be_written_are_refused(members, problem):
    with pytest.raises(SnapshotRefused) as refused:
        check(tar_gz(*[(m, b"x" * m.size) for m in members]))
    assert problem in refused.value.message


def test_deep_paths_are_checked_in_time_that_grows_with_their_length_not_its_square():
    deep = "/".join(["a"] * 1000)  # 2000 bytes, 1000 components: one tree walk each, not 1000 joins
    data = tar_gz(*[(info(f"{deep}/f{i}", size=0), b"") for i in range(2000)])
    start = time.perf_counter()
    assert check(data).files == 2000
    assert time.perf_counter() - start < 10


def test_resolving_symlinks_has_one_budget_for_the_whole_snapshot():
    winding = "x/.." + "/x/.." * 799 + "/y"  # 1601 steps to resolve, each link
    links = [(info(f"l{i}", kind=tarfile.SYMTYPE, link=winding), b"") for i in range(700)]
    assert check(tar_gz(*links[:100])).files == 100
    with pytest.raises(SnapshotRefused, match="its symlinks take more than 1000000 steps to resolve"):
        check(tar_gz(*links))


def pack_tree(files: dict[str, str], tmp: Path | None = None) -> bytes:
    import tempfile

    root = Path(tempfile.mkdtemp(dir=tmp))
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    data = pack(root).data
    shutil.rmtree(root)
    return data


def unpacked(data: bytes, tree: Path) -> dict[str, tuple[str, int]]:
    contents = check(data)
    hangar.tarballs.extract(io.BytesIO(data), tree, contents, hangar.tarballs.stream_limit(LIMIT, FILES))
    found = {}
    for path in sorted(tree.rglob("*")):
        mode = path.lstat().st_mode
        what = os.readlink(path) if path.is_symlink() else ("dir" if path.is_dir() else path.read_text())
        found[str(path.relative_to(tree))] = (what, stat.S_IMODE(mode))
    return found


def test_it_writes_files_links_and_modes_as_packed_never_set_id_bits_or_owners(tmp_path):
    setuid = info("bin/tool", size=2, mode=0o6777)
    setuid.uid, setuid.gid, setuid.uname = 4321, 4321, "someone"
    data = tar_gz(
        (info("bin", kind=tarfile.DIRTYPE, mode=0o777), b""),
        (setuid, b"#!"),
        (info("train.py", size=1, mode=0o600), b"x"),
        (info("run", kind=tarfile.SYMTYPE, link="bin/tool"), b""),
    )
    found = unpacked(data, tmp_path / "tree")
    assert found == {
        "bin": ("dir", 0o755),
        "bin/tool": ("#!", 0o755),
        "run": ("bin/tool", 0o777),
        "train.py": ("x", 0o644),
    }
    assert {path.lstat().st_uid for path in (tmp_path / "tree").rglob("*")} == {os.getuid()}


def test_what_pack_makes_unpacks_whole_and_a_member_cut_short_is_refused(tmp_path):
    data = pack_tree({"train.py": "print(1)", "lib/u.py": "y" * 3000}, tmp_path)
    assert unpacked(data, tmp_path / "ok")["lib/u.py"] == ("y" * 3000, 0o644)
    raw = zlib.decompress(data, 16 + zlib.MAX_WBITS)
    cut = gzip_bytes(raw[: raw.index(b"y" * 100) + 100])  # the member's data ends early
    with pytest.raises(SnapshotRefused, match="readable tar.gz|ends before"):
        unpacked(cut, tmp_path / "cut")


def test_hangar_code_refuses_a_bomb_with_the_reason(tmp_path):
    with pytest.raises(SnapshotError, match="cannot be unpacked: a tar GNU long name holds"):
        unpack(header_bomb(size=64 * MiB), tmp_path / "out")


# --- any Python 3.11 --------------------------------------------------------------------------


UNPACK_ANYWHERE = """
import io, json, os, sys, tarfile
sys.path.insert(0, {base!r})
from hangar.snapshots import unpack
from hangar import tarballs
data = open(sys.argv[1], "rb").read()
count = unpack(data, __import__("pathlib").Path(sys.argv[2]) / "client")
contents = tarballs.check_tarball(io.BytesIO(data), 10**8, 1000)
tarballs.extract(io.BytesIO(data), __import__("pathlib").Path(sys.argv[2]) / "agent", contents, 10**9)
print(json.dumps({{"version": sys.version.split()[0], "filter": hasattr(tarfile, "data_filter"), "count": count}}))
"""


@pytest.mark.parametrize("python", [SYSTEM_PYTHON, sys.executable])
def test_unpacking_works_on_every_python_3_11_with_or_without_tarfiles_filter(python, tmp_path):
    if not os.access(python, os.X_OK):
        pytest.skip(f"{python} is not on this machine")
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
    if version.stdout.strip() != "(3, 11)":
        pytest.skip(f"{python} is not a Python 3.11")
    (tmp_path / "src" / "lib").mkdir(parents=True)
    (tmp_path / "src" / "train.py").write_text("print(1)")
    (tmp_path / "src" / "lib" / "u.py").write_text("y")
    (tmp_path / "src" / "u.py").symlink_to("lib/u.py")
    (tmp_path / "code.tar.gz").write_bytes(pack(tmp_path / "src").data)
    script = UNPACK_ANYWHERE.format(base=str(BASE_DIR))
    done = subprocess.run(
        [python, "-I", "-c", script, str(tmp_path / "code.tar.gz"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["count"] == 3, said
    for side in ("client", "agent"):
        assert (tmp_path / side / "u.py").read_text() == "y" and (tmp_path / side / "u.py").is_symlink()
    if python == SYSTEM_PYTHON and tuple(map(int, said["version"].split(".")[:3])) < (3, 11, 4):
        assert said["filter"] is False  # the interpreter the old code failed on (TypeError: filter)


# --- reading headers as tarfile does ------------------------------------------------------------


def with_checksum(block: bytes, checksum: int) -> bytes:
    return block[:148] + b"%06o\0 " % checksum + block[156:]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_the_header_walk_reads_sizes_and_checksums_as_tarfile_does(fmt):
    member = info("d/é-ü.py" if fmt != tarfile.USTAR_FORMAT else "d/a.py", size=70_000, mode=0o755)
    block = member.tobuf(format=fmt, encoding="utf-8")[-512:]  # the member's own header, after any pax one
    assert hangar.tarballs.octal(block[124:136]) == 70_000
    assert hangar.tarballs.octal(block[148:156]) in hangar.tarballs.checksums(block)
    assert check(tar_gz((member, b"x" * 70_000), fmt=fmt)).size == 70_000


def test_a_header_summed_with_signed_bytes_is_read_as_tarfile_reads_it():
    """Old tar writers summed the header's bytes as signed chars: tarfile takes either sum."""
    block = tarfile.TarInfo("é.py").tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8")
    signed = 256 + sum(b - 256 if b > 127 else b for b in block[:148] + block[156:])
    old = with_checksum(block, signed)
    assert signed != hangar.tarballs.checksums(block)[0]  # the setup: the two sums differ
    with tarfile.open(fileobj=io.BytesIO(old + b"\0" * 1024)) as tar:
        assert tar.getnames() == ["é.py"]
    assert check(gzip_bytes(old + b"\0" * 1024)).files == 1


@pytest.mark.parametrize(
    "field, value",
    [(b"00000000644\0", 0o644), (b" 644 " + b"\0" * 7, 0o644), (b"\0" * 12, 0), (b"12\0garbage\0\0", 0o12)]
    + [(b"0o644" + b"\0" * 7, None), (b"-644" + b"\0" * 8, None)],
)
def test_a_size_field_is_read_as_tarfile_reads_it_or_refused(field, value):
    block = tarfile.TarInfo("a").tobuf(format=tarfile.GNU_FORMAT)
    block = block[:124] + field + block[136:]
    block = with_checksum(block, hangar.tarballs.checksums(block)[0])
    assert hangar.tarballs.octal(field) == value
    if value is not None:  # where the walk reads a number, tarfile reads the same one
        assert tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape").size == value


def test_a_size_in_base_256_is_refused_though_tarfile_would_read_it():
    block = info("big", size=9 * 1024**3).tobuf(format=tarfile.GNU_FORMAT)
    assert block[124] == 0x80  # the setup: GNU's base-256 for a size past 8 GiB
    with pytest.raises(SnapshotRefused, match="a tar header has a field that is not a number"):
        check(gzip_bytes(block + b"\0" * 1024))


def test_a_tarball_in_several_gzip_members_is_one_stream():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("a.py", "b.py"):
            tar.addfile(info(name, size=1), io.BytesIO(b"x"))
    raw = out.getvalue()
    assert check(gzip_bytes(raw[:1024]) + gzip_bytes(raw[1024:])).files == 2  # as `cat a.gz b.gz` makes
