"""A pipeline stage's directory on its node, and a rerun's copy of the earlier run's directory,
made by the first stage's attempt before its command, as that stage's uid.

What a stage wrote is the job's: nothing here opens, copies, chmods or follows it as root
except through descriptors opened with O_NOFOLLOW under a checked directory's (PRODUCT.md).
Root only
- opens the pipeline root (checked: the agent's own, writable by no one else) and, under it,
  the earlier run's directory and a fresh partial directory for the copy;
- opens the earlier run's files to the copying uid, and a run's files to its next stages
  (share_pipeline_files: only what one of that run's uids owns), and renames the finished copy
  into place, never over another;
- removes a failed copy by descriptors, so a failure leaves nothing behind.
The copy itself runs in a forked child that drops to the stage's uid before it reads anything
and works only through the two directory descriptors it inherits (the uid may not be able to
reach the paths). It follows no link (links are copied as links), copies the data extents only
(SEEK_DATA/SEEK_HOLE: a hole stays a hole), writes no set-id bit, and stops at
HANGAR_PIPELINE_MAX_BYTES; it reports on a pipe, one JSON object a line.
The walks open each entry under its folder's descriptor with O_NOFOLLOW | O_NONBLOCK, never with
os.fwalk (sandbox.each_entry says why).
"""

import contextlib
import ctypes
import errno
import gc
import json
import os
import secrets
import select
import signal
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from agent import sandbox
from agent.envcache import human
from jobs import pipelines
from jobs.models import FailureClass, PipelineRun, PipelineStage
from jobs.models.pipeline import PipelineUid

DIRECTORY, FILE = sandbox.DIRECTORY, sandbox.ENTRY  # never through a link; a FIFO opens at once
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_DEPTH = 64  # folders deeper than this are refused: every level holds two descriptors
CHUNK = 8 * 1024 * 1024
PROGRESS_SECONDS = 1.0  # how often the copy's progress is written to the run's row
CHECK_SECONDS = 0.5  # how soon a cancelled attempt stops its copy
SKIPPED_SHOWN = 10

PR_SET_PDEATHSIG = 1
RENAME_NOREPLACE = 1
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child must not dlopen


class CopyRefused(Exception):
    """The stage cannot start: its directory could not be made (the reason, said in its log)."""

    def __init__(self, reason: str, failure_class: str):
        super().__init__(reason)
        self.reason = reason
        self.failure_class = failure_class


class CopyStopped(Exception):
    """The attempt ended (cancelled, lost) while its directory was copied: nothing was kept."""


class Refused(Exception):
    """Raised in the copying child: why it stopped, and whose failure that is."""

    def __init__(self, reason: str, failure_class: str = FailureClass.USER):
        super().__init__(reason)
        self.failure_class = failure_class


# --- the agent's side ---------------------------------------------------------------------


def prepare_stage_directory(job, user, shared: bool, say: Callable, still_current: Callable | None = None) -> None:
    """Before a stage's process starts: its run's directory on this node, copied first from the
    earlier run's when the run is a rerun from a stage (as `user`, the uid the stage runs as),
    then shared with the run's other uids (`shared`: each stage runs as a uid of its own).
    Raises CopyRefused (said in the log) or CopyStopped; does nothing for other jobs."""
    stage = pipelines.stage_run_by(job)
    if stage is None:
        return
    run = stage.run
    if shared and user is not None:
        run.record_uid(user.uid)
    try:
        if run.copy_state and not os.path.lexists(run.directory):
            copy_earlier(run, user, say, still_current)
        prepare_pipeline_dir(run.directory, shared, owners_of(run) if shared else ())
    except OSError as exc:
        reason = f"could not prepare the pipeline directory {run.directory} on this node: {exc.strerror or exc}"
        say(reason, True)
        run.copy_ended(False, 0, reason)
        raise CopyRefused(reason, FailureClass.INFRA) from exc


def owners_of(run: PipelineRun) -> set[int]:
    """The uids a stage of `run` ran as: those recorded, and each stage job's own uid from
    HANGAR_JOB_UID_RANGE (a run begun before uids were recorded). Never root."""
    uids = set(PipelineUid.objects.filter(run=run).values_list("uid", flat=True))
    if uid_range := settings.HANGAR_JOB_UID_RANGE:
        jobs = PipelineStage.objects.filter(run=run, reused=False).values_list("job_id", flat=True)
        uids |= {sandbox.job_uid(job_id, uid_range, set()) for job_id in jobs}
    return uids - {0}


def copy_earlier(run: PipelineRun, user, say: Callable, still_current: Callable | None) -> None:
    """The rerun's directory as a copy of the earlier run's, or nothing at all (CopyRefused)."""
    directory = Path(run.directory)
    earlier = run.rerun_of
    label = f"pipeline run {run.rerun_of_id}"
    root = checked_directory(directory.parent)
    try:
        if earlier is None or not os.path.isdir(earlier.directory):
            fresh_directory(root, directory.name, user)
            note = f"{label}'s directory is not on this node: this run starts with an empty one"
            say(note)
            run.copy_ended(True, 0, note)
            return
        if user is not None:  # what the earlier stages wrote, 0600 as their own uids, readable by this one
            share_pipeline_files(Path(earlier.directory), owners_of(earlier), writable=False)
        copied = copy_into_place(run, root, open_earlier(Path(earlier.directory)), user, say, still_current, label)
    finally:
        os.close(root)
    say(f"copied {human(copied)} of {label}'s directory into this run's")


def copy_into_place(run, root: int, source: int, user, say, still_current, label: str) -> int:
    partial = f".copy-{run.pk}-{secrets.token_hex(8)}"
    try:
        target = partial_directory(root, partial, user)
        try:
            who = f"uid {user.uid}" if user is not None else "the agent's user"
            say(f"copying {label}'s directory into this run's, as {who} (at most {human(limit())})")
            result = run_copy(run, source, target, user, label, still_current)
        except CopyStopped:
            run.copy_ended(False, 0, "the attempt ended while the directory was copied; nothing was kept")
            raise
        finally:
            os.close(target)
        if result.get("ended") != "done":
            reason = result.get("reason") or "the copy stopped"
            say(reason, True)
            run.copy_ended(False, result.get("copied", 0), reason)
            raise CopyRefused(reason, result.get("class") or FailureClass.INFRA)
        if note := skipped_note(result):
            say(note)
        if not rename_into_place(root, partial, Path(run.directory).name):
            say("another rank of this attempt copied the directory first: its copy is kept")
        run.copy_ended(True, result["copied"], note)
        return result["copied"]
    finally:
        os.close(source)
        sandbox.remove_tree(root, partial)  # gone already when renamed into place


def run_copy(run, source: int, target: int, user, label: str, still_current) -> dict:
    """Copy in a child as `user`; its last report (ended: done or refused) or why it died. Its
    progress (a report each PROGRESS_SECONDS) is written to the run's row as it comes."""
    began = False

    def heard(message: dict) -> None:
        nonlocal began
        if "total" in message:
            began = run.copy_began(message["total"])
        elif began:
            run.copy_progressed(message["copied"])

    quota = limit()
    pid, out = fork_as(user, lambda write: copy_child(write, source, target, quota, label), keep=(source, target))
    return follow(pid, out, heard, still_current)


def follow(pid: int, out: int, heard: Callable[[dict], None], still_current: Callable | None) -> dict:
    """Read the child's reports until it ends (each but the last to `heard`); kill it when the
    attempt ends meanwhile."""
    final: dict = {}
    buffer = b""
    next_check = time.monotonic() + CHECK_SECONDS
    status = None
    try:
        while True:
            if select.select([out], [], [], CHECK_SECONDS)[0]:
                chunk = os.read(out, 65536)
                if not chunk:
                    break
                *lines, buffer = (buffer + chunk).split(b"\n")
                for line in lines:
                    message = json.loads(line)
                    if "ended" in message:
                        final = message
                    else:
                        heard(message)
            if still_current is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + CHECK_SECONDS
                if not still_current():
                    raise CopyStopped()
        status = reap(pid)
    finally:
        os.close(out)
        if status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            reap(pid)
    if final or status == -1:
        return final or {"ended": "refused", "class": FailureClass.INFRA, "reason": "the copy process vanished"}
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}"
    return {"ended": "refused", "class": FailureClass.INFRA, "reason": f"the copy process ended without a word ({how})"}


def reap(pid: int) -> int:
    """The child's wait status; -1 when another reaped it (an agent ignoring SIGCHLD)."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return -1


def skipped_note(result: dict) -> str:
    skipped = result.get("skipped") or []
    if not skipped:
        return ""
    more = result.get("skipped_count", len(skipped)) - len(skipped)
    names = ", ".join(skipped) + (f" and {more} more" if more > 0 else "")
    return f"not copied ({len(skipped) + max(more, 0)}): {names}"


def limit() -> int:
    return settings.HANGAR_PIPELINE_MAX_BYTES


# --- root's own operations: checked directories, by descriptors ----------------------------


def checked_directory(path: Path) -> int:
    """A descriptor of `path`, a directory of the agent's own that no one else may write (the
    pipeline root): what is made, renamed and removed in it is the agent's alone to name."""
    fd = os.open(path, DIRECTORY)
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        os.close(fd)
        who = "the agent's user" if os.geteuid() else "root"
        raise OSError(errno.EPERM, f"{path} must belong to {who} and be writable by no one else: chmod go-w it")
    return fd


def open_run_directory(directory: Path) -> int:
    """A run's directory, opened O_NOFOLLOW under its checked parent (the pipeline root)."""
    root = checked_directory(directory.parent)
    try:
        return os.open(directory.name, DIRECTORY, dir_fd=root)
    finally:
        os.close(root)


def open_earlier(directory: Path) -> int:
    """The earlier run's directory, searchable by job uids (the agent made it: its entry is the
    agent's, its contents the stages')."""
    fd = open_run_directory(directory)
    info = os.fstat(fd)
    if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) & 0o005 != 0o005:
        os.fchmod(fd, stat.S_IMODE(info.st_mode) | 0o555)
    return fd


def partial_directory(root: int, name: str, user) -> int:
    os.mkdir(name, 0o700, dir_fd=root)
    fd = os.open(name, DIRECTORY, dir_fd=root)
    if user is not None and user.uid != os.geteuid():
        os.fchown(fd, user.uid, user.gid)
    return fd


def fresh_directory(root: int, name: str, user) -> None:
    with contextlib.suppress(FileExistsError):  # another rank made it first
        os.close(partial_directory(root, name, user))


def rename_into_place(root: int, partial: str, name: str) -> bool:
    """Move the finished copy to the run's name, never over a directory already there (another
    rank's copy, whose stage may be running in it); False when one was."""
    if _libc.renameat2(root, partial.encode(), root, name.encode(), RENAME_NOREPLACE) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        return False
    if code not in (errno.EINVAL, errno.ENOSYS):  # a filesystem without the flag: check, then rename
        raise OSError(code, os.strerror(code), name)
    try:
        os.stat(name, dir_fd=root, follow_symlinks=False)
        return False
    except FileNotFoundError:
        os.rename(partial, name, src_dir_fd=root, dst_dir_fd=root)
        return True


def prepare_pipeline_dir(path: str, shared: bool, owners: Collection[int]) -> None:
    """A pipeline run's directory (jobs/pipelines.py), made here too when the portal's is on
    another machine. `shared`: each stage runs as a uid of its own, and all of them write
    there (`owners`: the uids the run's stages ran as); its name is unguessable and the
    sandbox hides its root from every other job."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    if not shared:
        return
    root = directory.parent  # HANGAR_PIPELINE_ROOT: searchable by job uids, never listable
    if not root.stat().st_mode & stat.S_IXOTH:
        try:
            root.chmod(0o711)
        except OSError as exc:
            raise OSError(f"job uids cannot reach {root}: chmod o+x it, or move HANGAR_PIPELINE_ROOT ({exc})")
    fd = open_run_directory(directory)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != 0o777:
            os.fchmod(fd, 0o777)
        share_tree(fd, frozenset(owners) - {0}, writable=True)
    finally:
        os.close(fd)


def share_pipeline_files(directory: Path, owners: Collection[int], writable: bool = True) -> None:
    """What earlier stages left in the run's directory, made readable and writable by the next
    ones (each its own uid; Hangar's umask is 077), or only readable (`writable` False: by the
    uid that copies it for a rerun); nothing when it is not on this node."""
    try:
        fd = open_run_directory(Path(directory))
    except FileNotFoundError:
        return
    try:
        share_tree(fd, frozenset(owners) - {0}, writable)
    finally:
        os.close(fd)


def share_tree(top: int, owners: frozenset[int], writable: bool) -> None:
    """Open what is in the directory `top` to the run's other uids: files and folders owned by
    one of `owners` only (not a file a stage hard-linked in from elsewhere), each opened with
    O_NOFOLLOW under its folder's descriptor (sandbox.each_entry); set-id bits are dropped."""

    def share(fd: int, info: os.stat_result) -> bool:
        if info.st_uid not in owners:
            return False  # not this run's: hard-linked in from elsewhere, or another user's
        is_dir = stat.S_ISDIR(info.st_mode)
        os.fchmod(fd, shared_mode(stat.S_IMODE(info.st_mode), is_dir, writable))
        return True

    sandbox.each_entry(top, share)


def shared_mode(mode: int, is_dir: bool, writable: bool) -> int:
    """A shared entry's mode: every uid reads it (and writes it, for the run's next stages);
    executables stay executable for all; set-id and sticky bits are dropped."""
    mode &= 0o777
    if is_dir:
        return 0o777 if writable else mode | 0o555
    executable = 0o111 if mode & 0o100 else 0
    return mode | (0o666 if writable else 0o444) | executable


# --- the child: as the stage's uid, through the two descriptors only ------------------------


def fork_as(user, work: Callable[[int], None], keep: tuple[int, ...] = ()) -> tuple[int, int]:
    """Run `work(write_fd)` in a forked child as `user` (or the agent's own user); the child's
    pid and the read end of its pipe. No exec: the agent's interpreter may be one job uids
    cannot run. The child closes every descriptor but `keep` and its pipe first (the agent's
    sockets, locks and other jobs' pipes), touches no lock, log or connection of the parent's
    threads, keeps the garbage collector off (a finaliser could speak on a parent's socket),
    and ends with os._exit whatever happens."""
    read, write = os.pipe()
    parent = os.getpid()
    collecting = gc.isenabled()
    gc.disable()
    try:
        pid = os.fork()
    except BaseException:
        os.close(read)
        os.close(write)
        raise
    finally:
        if collecting and os.getpid() == parent:
            gc.enable()
    if pid == 0:  # the child
        code = 70
        try:
            close_all_but({*keep, write})
            drop_to(user, parent)
            work(write)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - reported, then gone
            try:
                report(write, ended="refused", **{"class": FailureClass.INFRA, "reason": f"the copy failed: {exc}"})
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(code)
    os.close(write)
    return pid, read


def close_all_but(keep: set[int]) -> None:
    low = 3
    for fd in sorted(fd for fd in keep if fd >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def drop_to(user, parent: int) -> None:
    """Become `user` for good (groups, then gid, then uid: root's capabilities go with it, and
    the kernel makes the process undumpable, so the uid's jobs cannot ptrace it), and die with
    the thread that forked this child (the uid change clears that signal: set after)."""
    if user is not None and (user.uid, user.gid) != (os.geteuid(), os.getegid()):
        os.setgroups(list(user.groups))
        os.setresgid(user.gid, user.gid, user.gid)
        os.setresuid(user.uid, user.uid, user.uid)
        if set(os.getresuid()) != {user.uid} or set(os.getresgid()) != {user.gid}:
            raise OSError(errno.EPERM, f"could not become uid {user.uid}")
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(71)
    os.umask(0o077)


def report(out: int, **message) -> None:
    os.write(out, json.dumps(message).encode() + b"\n")


@dataclass
class Budget:
    """What the copy may still write, and what it tells the agent."""

    limit: int
    out: int
    label: str
    copied: int = 0
    skipped: list[str] = field(default_factory=list)
    skipped_count: int = 0
    reported: float = 0.0

    def take(self, size: int) -> None:
        if self.copied + size > self.limit:
            raise Refused(over_quota(self.label, self.copied + size, self.limit))

    def add(self, size: int) -> None:
        self.copied += size
        if time.monotonic() - self.reported >= PROGRESS_SECONDS:
            self.reported = time.monotonic()
            report(self.out, copied=self.copied)

    def skip(self, path: str, why: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < SKIPPED_SHOWN:
            self.skipped.append(f"{path} ({why})")


def over_quota(label: str, size: int, quota: int) -> str:
    return (
        f"{label}'s directory holds {human(size)} or more, over HANGAR_PIPELINE_MAX_BYTES ({human(quota)}), "
        "the most a rerun copies: the user's to change. Keep less in HANGAR_PIPELINE_DIR, run the pipeline "
        "again from its first stage (it copies nothing), or ask an operator to raise HANGAR_PIPELINE_MAX_BYTES"
    )


def copy_child(out: int, source: int, target: int, quota: int, label: str) -> None:
    """The child's work, as the stage's uid: measure, refuse over the quota, copy."""
    budget = Budget(quota, out, label)
    try:
        total = measure(source)
        report(out, total=total)
        budget.take(total)
        copy_tree(source, target, budget, "")
    except Refused as exc:
        report(out, ended="refused", copied=budget.copied, reason=str(exc), **{"class": exc.failure_class})
        return
    except OSError as exc:
        reason = f"the copy failed on this node: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
        report(out, ended="refused", copied=budget.copied, reason=reason, **{"class": FailureClass.INFRA})
        return
    report(out, ended="done", copied=budget.copied, skipped=budget.skipped, skipped_count=budget.skipped_count)


def too_deep() -> str:
    return (
        f"the directory is more than {MAX_DEPTH} folders deep, deeper than a rerun copies: the user's to change. "
        "Keep fewer nested folders in HANGAR_PIPELINE_DIR, or run the pipeline again from its first stage"
    )


def data_size(info: os.stat_result) -> int:
    """What a file holds on disk, at most its length: a sparse file's holes cost nothing."""
    return min(info.st_size, info.st_blocks * 512)


def measure(top: int, depth: int = 0) -> int:
    """The bytes of data under `top` that this uid can read (what the copy will write)."""
    total = 0
    with os.scandir(top) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                try:
                    total += data_size(entry.stat(follow_symlinks=False))
                except OSError:
                    continue  # gone meanwhile
            elif entry.is_dir(follow_symlinks=False):
                if depth >= MAX_DEPTH:
                    raise Refused(too_deep())
                try:
                    fd = os.open(entry.name, DIRECTORY, dir_fd=top)
                except OSError:
                    continue  # the copy says so
                try:
                    total += measure(fd, depth + 1)
                finally:
                    os.close(fd)
    return total


def copy_tree(source: int, target: int, budget: Budget, path: str, depth: int = 0) -> None:
    with os.scandir(source) as entries:
        for entry in entries:
            where = f"{path}{entry.name}"
            try:
                info = entry.stat(follow_symlinks=False)
                link = os.readlink(entry.name, dir_fd=source) if stat.S_ISLNK(info.st_mode) else None
            except OSError:  # gone, or no longer a link: a stage still writing
                budget.skip(where, "changed while copied")
                continue
            if stat.S_ISDIR(info.st_mode):
                if depth >= MAX_DEPTH:
                    raise Refused(too_deep())
                copy_folder(source, target, entry.name, info, budget, where, depth)
            elif stat.S_ISREG(info.st_mode):
                copy_file(source, target, entry.name, budget, where)
            elif link is not None:
                os.symlink(link, entry.name, dir_fd=target)  # as a link: whoever follows it does so as a job uid
            else:
                budget.skip(where, "not a file, folder or link")


def copy_folder(source: int, target: int, name: str, info, budget: Budget, where: str, depth: int) -> None:
    try:
        inner = os.open(name, DIRECTORY, dir_fd=source)
    except PermissionError:
        budget.skip(where + "/", "this uid cannot read it")
        return
    except OSError:
        budget.skip(where + "/", "changed while copied")
        return
    try:
        os.mkdir(name, 0o700, dir_fd=target)
        made = os.open(name, DIRECTORY, dir_fd=target)
        try:
            copy_tree(inner, made, budget, where + "/", depth + 1)
            os.fchmod(made, stat.S_IMODE(info.st_mode) & 0o777 | 0o700)
            os.utime(made, ns=(info.st_atime_ns, info.st_mtime_ns))
        finally:
            os.close(made)
    finally:
        os.close(inner)


def copy_file(source: int, target: int, name: str, budget: Budget, where: str) -> None:
    try:
        src = os.open(name, FILE, dir_fd=source)
    except PermissionError:
        budget.skip(where, "this uid cannot read it")
        return
    except OSError:
        budget.skip(where, "changed while copied")
        return
    try:
        info = os.fstat(src)  # what was opened, whatever the name pointed at before
        if not stat.S_ISREG(info.st_mode):
            budget.skip(where, "changed while copied")
            return
        dst = os.open(name, CREATE, 0o600, dir_fd=target)
        try:
            copy_data(src, dst, info.st_size, budget)
            os.fchmod(dst, stat.S_IMODE(info.st_mode) & 0o777)  # never a set-id bit
            os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))
        finally:
            os.close(dst)
    finally:
        os.close(src)


def copy_data(src: int, dst: int, size: int, budget: Budget) -> None:
    """The file's data extents, each at its offset; its holes stay holes (the length is set last)."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = min(os.lseek(src, start, os.SEEK_HOLE), size)
        if start >= end or not copy_range(src, dst, start, end, budget):
            break
        offset = end
    os.ftruncate(dst, size)


def copy_range(src: int, dst: int, start: int, end: int, budget: Budget) -> bool:
    """Copy [start, end); False when the file ended sooner (it shrank meanwhile)."""
    while start < end:
        size = min(CHUNK, end - start)
        budget.take(size)
        try:
            done = os.copy_file_range(src, dst, size, start, start)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            data = os.pread(src, size, start)
            done = os.pwrite(dst, data, start) if data else 0
        if done == 0:
            return False
        budget.add(done)
        start += done
    return True
