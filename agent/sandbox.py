"""One sandbox per job: its own uid, and its own user, PID, IPC and mount namespaces (bubblewrap).

Everything that decides is a plain function over plain data (`job_uid`, `bwrap_argv`,
`gpu_devices`, `isolation`), table-tested in tests/test_sandbox.py without a database;
the Runner (agent/runner.py) gathers the data and starts what `wrap` returns.

How the sandbox is built, and why in this order (see TRAPS.md):
- the agent (root) drops to the job's uid with setpriv first, and bwrap then makes its
  namespaces unprivileged: bwrap started as root would map the job to root;
- that setpriv also sets the parent-death signal, after the uid change (which clears it),
  so everything after it (env, bwrap, until its --die-with-parent) dies with the runner's
  thread; no program of its own is started for it (`leader_argv`);
- bwrap resolves every bind source as the job's uid, so the path to the job's directory
  must be searchable by it (`prepare_node` makes the data directory 0711, its files 0600);
- the outer bwrap dies on SIGTERM and takes the sandbox with it, so a stop's SIGTERM goes
  to the sandbox's own process group, not to the outer bwrap's: --new-session makes the
  sandbox's init (bwrap, pid 1 in it, which a signal from outside without a handler of its
  own does not end) the leader of a session and group that the command and what it starts
  share, and --info-fd tells the agent that init's host pid (`init_pid`). A cancel or a
  preemption reaches the job's processes with their grace period; the SIGKILL after it
  ends the outer bwrap too. (Before, `env --ignore-signal=TERM` before bwrap and
  `env --default-signal=TERM` before the command did it with one group: two programs
  more in every start, ~1.3 ms, bench/start_latency.py.)
- bwrap's pid 1 ends every process of the sandbox when the command exits, and
  --die-with-parent replaces the PDEATHSIG that the uid change clears.
"""

import errno
import functools
import json
import logging
import os
import select
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent import reach, stage

log = logging.getLogger("hangar.agent")

# Always bound on a node with real GPUs: the driver's control devices. Missing ones are skipped.
NVIDIA_CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")

ISOLATION_SANDBOX = "sandbox"  # own uid + bubblewrap
ISOLATION_UID = "uid"  # own uid, no bubblewrap (HANGAR_SANDBOX=off)
ISOLATION_NONE = "none"  # the agent's user (not root, or HANGAR_JOB_UID_RANGE=off)


@dataclass(frozen=True)
class Bind:
    path: str
    writable: bool = False
    ours: bool = False  # Hangar's own directory (not a user's volume): may be staged (agent/stage.py)


@dataclass(frozen=True)
class Sandbox:
    """What one rank's sandbox is made of: plain paths and numbers."""

    uid: int
    workdir: str
    checkpoint_dir: str = ""
    hidden: tuple[str, ...] = ()  # Hangar's data dir, the job workdir root, spool, volume roots
    binds: tuple[Bind, ...] = ()  # the environment's path (ro) and the job's volumes as declared
    gpus: tuple[int, ...] = ()
    real_gpus: bool = False
    network: str = "host"  # "none": loopback only
    bwrap: str = "bwrap"
    setpriv: str = "setpriv"
    devices: tuple[str, ...] = field(default=NVIDIA_CONTROL_DEVICES)
    tools: tuple[str, ...] = ()  # interpreter prefixes the job runs from, bound read-only where they are
    sources: tuple[tuple[str, str], ...] = ()  # a bind's path -> where bwrap finds it (agent/stage.py)
    enter: tuple[str, ...] = ()  # what starts bwrap in the staging namespace, when a source is staged


def job_uid(job_id: int, uid_range: tuple[int, int], busy: set[int]) -> int:
    """The job's uid: its id's place in the range, the same for every attempt; the next
    free one when another live job (or a process) on this node holds that one."""
    low, high = uid_range
    size = high - low + 1
    for step in range(size):
        uid = low + (job_id + step) % size
        if uid not in busy:
            return uid
    raise OSError(f"every uid of HANGAR_JOB_UID_RANGE {low}-{high} is in use on this node")


def gpu_devices(gpus: tuple[int, ...] | list[int], control: tuple[str, ...] = NVIDIA_CONTROL_DEVICES) -> list[str]:
    """The device nodes a job on real GPUs may open: its own /dev/nvidiaN and the control devices."""
    return [*(f"/dev/nvidia{index}" for index in sorted(gpus)), *control]


def under(path: str, parents: list[str] | tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


def hidden_mounts(hidden: tuple[str, ...]) -> list[str]:
    """tmpfs over each hidden path, outermost first; one inside another (or inside /tmp) is already gone."""
    out: list[str] = []
    for path in sorted({os.path.normpath(p) for p in hidden if p}, key=len):
        if path != "/" and not under(path, ["/tmp", *out]):
            out.append(path)
    return out


def bwrap_argv(box: Sandbox, command: list[str], info_fd: int | None = None) -> list[str]:
    """The argv that runs `command` in `box` (see the module's docstring for the order);
    `info_fd`: where bwrap writes its init's pid (an fd the started process inherits)."""
    argv = [*box.enter, box.setpriv, f"--reuid={box.uid}", f"--regid={box.uid}", "--clear-groups", "--no-new-privs"]
    argv += ["--pdeathsig", "KILL", "--", box.bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc"]
    if box.network == "none":
        argv.append("--unshare-net")
    argv += ["--die-with-parent", "--new-session"]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    argv += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    hidden = hidden_mounts(box.hidden)
    for path in hidden:
        argv += ["--tmpfs", path]
    if box.real_gpus:
        for device in gpu_devices(box.gpus, box.devices):
            argv += ["--dev-bind-try", device, device]
    sources = dict(box.sources)
    for bind in all_binds(box):
        argv += ["--bind" if bind.writable else "--ro-bind", sources.get(bind.path, bind.path), bind.path]
    for path in hidden:  # what Hangar hides stays read-only: a write there fails, never lands in a throwaway tmpfs
        argv += ["--remount-ro", path]
    argv += ["--chdir", box.workdir, "--", *command]
    return argv


def all_binds(box: Sandbox) -> list[Bind]:
    """What the sandbox binds, outermost first: the job's own directories, its environment,
    pipeline directory and volumes, and the interpreters it runs from."""
    own = [Bind(box.workdir, writable=True, ours=True)]
    if box.checkpoint_dir and not under(box.checkpoint_dir, [box.workdir]):
        own.append(Bind(box.checkpoint_dir, writable=True, ours=True))
    return [*own, *box.binds, *(Bind(path, ours=True) for path in box.tools)]


def init_pid(info: int, timeout: float = 5.0) -> int | None:
    """The host pid of a sandbox's init, from the read end of its bwrap's --info-fd: the
    leader of the job's process group. bwrap writes it as it makes the namespaces; None when
    it wrote none (it failed first, or has not written in `timeout` seconds)."""
    try:
        if not select.select([info], [], [], timeout)[0]:
            return None
        return int(json.loads(os.read(info, 4096))["child-pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def isolation(euid: int, uid_range: tuple[int, int] | None, sandbox_on: bool, bwrap_found: bool) -> tuple[str, str]:
    """This node's isolation mode and, when it is less than a sandbox, why."""
    if uid_range is None:
        return ISOLATION_NONE, "HANGAR_JOB_UID_RANGE=off: jobs run as the agent's user (or HANGAR_JOB_USER)"
    if euid != 0:
        return ISOLATION_NONE, "the agent does not run as root: jobs run as its own user, with no sandbox"
    if not sandbox_on:
        return ISOLATION_UID, "HANGAR_SANDBOX=off: each job has its own uid but sees the whole file system"
    if not bwrap_found:
        return ISOLATION_UID, "bubblewrap (bwrap) is not installed: apt-get install bubblewrap"
    return ISOLATION_SANDBOX, ""


# --- the agent's side: settings, the file system, /proc ----------------------------------


@dataclass(frozen=True)
class Tools:
    bwrap: str | None
    setpriv: str | None
    prlimit: str | None = None


@functools.cache
def tools() -> Tools:
    """Resolved once, with the agent's own PATH: a job's environment never chooses them."""
    return Tools(shutil.which("bwrap"), shutil.which("setpriv"), shutil.which("prlimit"))


def leader_argv(
    argv: list[str],
    as_user: dict,
    memory_limit_mb: int,
    found: Tools,
    euid: int | None = None,
    dies_with_parent: bool = False,
) -> list[str] | None:
    """The argv that starts a job's leader with programs doing what a preexec function did
    between fork and exec: the memory limit (prlimit: RLIMIT_AS, inherited by all it starts),
    the job user (`as_user`: Popen's user/group/extra_groups, done by setpriv) and the
    parent-death signal (setpriv --pdeathsig: the leader dies with the runner's thread). One
    setpriv does both: it sets the signal after the uid change, which clears it. Started
    this way, with no preexec function and no uid to change, Python spawns it with vfork:
    forking the agent's few hundred MB cost ~17 ms of CPU per job, half of it copy-on-write
    faults in the agent's own threads. Each program in the chain costs ~0.6 ms of CPU and
    as much of the job's start.

    `dies_with_parent`: `argv`'s own first program sets the signal (a sandbox's setpriv,
    `bwrap_argv`), so only the memory limit, if any, is put before it.

    None when a program it needs is missing, or a uid change is asked of an agent that is
    not root: the caller then forks with a preexec function, as before (and Popen reports a
    uid it may not take)."""
    euid = os.geteuid() if euid is None else euid
    if found.setpriv is None or (memory_limit_mb and found.prlimit is None) or (as_user and euid != 0):
        return None
    lead: list[str] = []
    if memory_limit_mb:
        limit = memory_limit_mb * 1024 * 1024
        lead += [found.prlimit, f"--as={limit}:{limit}", "--"]
    if as_user:
        groups = ",".join(str(gid) for gid in as_user.get("extra_groups") or ())
        lead += [found.setpriv, f"--reuid={as_user['user']}", f"--regid={as_user['group']}"]
        lead += [f"--groups={groups}" if groups else "--clear-groups", "--pdeathsig", "KILL", "--"]
    elif not dies_with_parent:
        lead += [found.setpriv, "--pdeathsig", "KILL", "--"]
    return [*lead, *argv]


def mode() -> tuple[str, str]:
    from django.conf import settings

    found = tools()
    return isolation(
        os.geteuid(),
        settings.HANGAR_JOB_UID_RANGE,
        settings.HANGAR_SANDBOX,
        bool(found.bwrap and found.setpriv),
    )


@functools.cache
def announce(isolation_mode: str, reason: str) -> None:
    """Said once per process, at start: isolation is never weaker than configured in silence."""
    if reason:
        log.warning("isolation: %s (%s)", isolation_mode, reason)
    else:
        log.info("isolation: sandbox (own uid and bubblewrap namespaces for every job)")


def uids_in_use() -> set[int]:
    """Uids of the processes on this machine (every agent's jobs, an earlier attempt still
    ending): a new job never takes one of them."""
    uids = set()
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                try:
                    uids.add(entry.stat(follow_symlinks=False).st_uid)
                except OSError:
                    pass
    return uids


def prepare_node(data_dir: Path, workdir_root: Path, sandboxed: bool = False) -> None:
    """Let job uids reach their own directories (search, never list): the data directory and
    the job workdir root become 0711; the files in them stay 0600, their other folders 0700.
    Without a sandbox, a closed directory above them is an error saying what to open; in one,
    the workdir root is staged instead (agent/stage.py)."""
    workdir_root.mkdir(parents=True, exist_ok=True)
    for path in [*Path(workdir_root).parents, workdir_root]:
        if path == workdir_root or under(str(path), [str(data_dir)]):  # Hangar's own folders
            path.chmod(0o711)
        elif not sandboxed and not path.stat().st_mode & stat.S_IXOTH:
            raise OSError(f"job uids cannot reach {workdir_root}: chmod o+x {path}, or move HANGAR_JOB_WORKDIR")


def prepare_job_dirs(workdir: Path, checkpoints: Path, uid: int, gid: int | None = None) -> None:
    """The job's directory and checkpoint directory: 0700 and its uid's (again when an earlier
    attempt ran as another uid). An earlier attempt may have left links in them, or put one in
    the checkpoint directory's place: both are opened and walked through descriptors with
    O_NOFOLLOW, never by path, and whatever stands in the checkpoint directory's place is removed."""
    workdir.mkdir(parents=True, exist_ok=True)  # its parents are Hangar's: no job writes there
    top = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if checkpoints.parent == workdir:
            inner = own_subdir(top, checkpoints.name)
        else:  # under HANGAR_CHECKPOINT_ROOT: Hangar's own parents
            checkpoints.mkdir(parents=True, exist_ok=True)
            inner = os.open(checkpoints, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for fd in (top, inner):
                give_tree(fd, uid, uid if gid is None else gid)
        finally:
            os.close(inner)
    finally:
        os.close(top)


def own_subdir(parent: int, name: str) -> int:
    """A descriptor of the directory `name` in `parent`, made if missing; a link or a file in its
    place (what a job can leave there) is removed, never followed."""
    for _ in range(3):
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:
            pass
        try:
            return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            os.unlink(name, dir_fd=parent)
    raise OSError(errno.EAGAIN, f"{name} keeps being replaced while it is made")


def give_tree(fd: int, uid: int, gid: int) -> None:
    """The directory `fd` and what is in it made `uid`'s (unless it is already), and 0700. A
    file with other hard links is left alone: it may be another owner's file linked in, which
    a chown would hand over."""

    def give(entry: int, info: os.stat_result) -> bool:
        if not (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
            os.fchown(entry, uid, gid)
        return True

    info = os.fstat(fd)
    if info.st_uid != uid:
        os.fchown(fd, uid, gid)
        each_entry(fd, give)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.fchmod(fd, 0o700)


# How root opens what is in a job's tree: never through a link (O_NOFOLLOW), and a FIFO swapped
# in for a file opens at once (O_NONBLOCK) instead of holding the agent.
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
ENTRY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
MAX_DEPTH = 64  # deeper folders are not walked: every level holds a descriptor


def remove_tree(parent: int, name: str, depth: int = 0) -> None:
    """Remove `name` under the directory `parent` and all in it, by descriptors: a link is removed,
    never followed (shutil.rmtree opens each folder it lists without O_NOFOLLOW, as os.fwalk does)."""
    try:
        fd = os.open(name, DIRECTORY, dir_fd=parent)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=parent)  # a file, a FIFO or a link: removed, not opened
        return
    try:
        if depth >= MAX_DEPTH:
            raise OSError(errno.ELOOP, f"more than {MAX_DEPTH} folders deep", name)
        for child in os.listdir(fd):
            remove_tree(fd, child, depth + 1)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def remove_path(path: Path) -> None:
    """`remove_tree` of a path whose parent is Hangar's (a job's code copy, a check's scratch)."""
    parent = os.open(path.parent, DIRECTORY)
    try:
        remove_tree(parent, path.name)
    finally:
        os.close(parent)


def each_entry(top: int, visit: Callable[[int, os.stat_result], bool], depth: int = 0) -> None:
    """Every file and folder under the directory `top`, opened under its folder's descriptor and
    handed to `visit(fd, its fstat)`, which says whether to go into a folder. Not os.fwalk: it
    opens a listed folder without O_NOFOLLOW, so a link a job swaps in is followed (to a FIFO:
    the open blocks) before the swap is noticed. Links and other kinds are passed over."""
    with os.scandir(top) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                flags = DIRECTORY
            elif entry.is_file(follow_symlinks=False):
                flags = ENTRY
            else:
                continue
            try:
                fd = os.open(entry.name, flags, dir_fd=top)
            except OSError:
                continue  # swapped for a link, or gone meanwhile
            try:
                info = os.fstat(fd)
                if not (stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
                    continue  # a FIFO (or a device) swapped in between the listing and the open
                if visit(fd, info) and stat.S_ISDIR(info.st_mode) and depth < MAX_DEPTH:
                    each_entry(fd, visit, depth + 1)
            finally:
                os.close(fd)


@dataclass(frozen=True)
class Launch:
    """How the Runner starts one rank of an isolated job: as `uid`, wrapped in `box` when set."""

    uid: int
    box: Sandbox | None

    def wrap(
        self, argv: list[str], env: dict[str, str], workdir: Path, info_fd: int | None = None
    ) -> tuple[list[str], dict[str, str]]:
        env = {**env, "HOME": str(workdir), "USER": f"job-{self.uid}", "LOGNAME": f"job-{self.uid}"}
        if self.box is None:
            return argv, env
        return bwrap_argv(self.box, argv, info_fd), {**env, "TMPDIR": "/tmp"}

    def popen_user(self) -> dict:
        """Popen's arguments: a host job without a sandbox drops to the uid itself (with the
        sandbox setpriv does; a container's docker client stays the agent's)."""
        if self.box is not None:
            return {}
        return {"user": self.uid, "group": self.uid, "extra_groups": []}

    def returncode(self, code: int) -> int:
        """bwrap reports a command killed by signal N as exit code 128 + N: the signal again."""
        if self.box is not None and 128 < code < 128 + 65:
            return -(code - 128)
        return code


def launch_for(
    job, gpus: list[int], workdir: Path, real_gpus: bool, container: bool, env_path: Path | None = None
) -> Launch | None:
    """The job's uid and sandbox on this node, or None when the node isolates nothing
    (not root, HANGAR_JOB_UID_RANGE=off: today's behaviour, announced at start).
    `env_path`: its cached environment, bound read-only (it lies in the hidden data directory)."""
    from django.conf import settings

    isolation_mode, reason = mode()
    announce(isolation_mode, reason)
    if isolation_mode == ISOLATION_NONE:
        return None
    boxed = isolation_mode == ISOLATION_SANDBOX and not container
    prepare_node(settings.DATA_DIR, settings.HANGAR_JOB_WORKDIR, sandboxed=boxed)
    uid = job_uid(job.pk, settings.HANGAR_JOB_UID_RANGE, uids_in_use() - {owner_of(workdir)})
    prepare_job_dirs(workdir, job.checkpoint_dir(), uid)
    if not boxed:
        return Launch(uid, None)
    found = tools()
    box = Sandbox(
        uid=uid,
        workdir=str(workdir),
        checkpoint_dir=str(job.checkpoint_dir()),
        hidden=hidden_paths(settings),
        binds=job_binds(job, env_path),
        gpus=tuple(gpus),
        real_gpus=real_gpus,
        network=getattr(job.project, "network", "host"),
        bwrap=found.bwrap,
        setpriv=found.setpriv,
    )
    return Launch(uid, with_interpreters(box, interpreter_roots(job, env_path), settings))


def with_interpreters(box: Sandbox, roots: list[str], settings) -> Sandbox:
    """`box` with the interpreter prefixes `roots` bound where its job would not see them
    otherwise, and what its uid cannot reach staged (`reachable`)."""
    box = replace(box, tools=reach.tools_to_bind(roots, view_of(box)))
    return reachable(box, staging_roots(settings))


def interpreter_roots(job, env_path: Path | None) -> list[str]:
    """The prefixes the job's Python runs from: the node's job Python (first on its PATH),
    and its environment's (a cached one, or a host one's path) with the installation under it."""
    roots = reach.python_roots(reach.default_python())
    environment = job.environment
    prefix = str(env_path) if env_path is not None else (environment.path if environment is not None else "")
    return list(dict.fromkeys([*roots, *(reach.prefix_roots(prefix) if prefix else ())]))


def job_view(launch: "Launch | None") -> reach.View:
    """What a job started by `launch` sees: everything (no uid of its own), the host as its uid
    may (no sandbox), or its sandbox."""
    if launch is None:
        return reach.View(sandboxed=False, everything=True)
    if launch.box is None:
        return reach.View(sandboxed=False)
    return view_of(launch.box)


def view_of(box: Sandbox) -> reach.View:
    """What the job in `box` sees: its binds wherever they are, the rest as its uid may."""
    return reach.View(sandboxed=True, hidden=box.hidden, bound=tuple(b.path for b in all_binds(box)))


def staging_roots(settings) -> list[str]:
    """Hangar's own directories, staged whole when job uids cannot reach them (agent/stage.py)."""
    roots = [settings.HANGAR_JOB_WORKDIR, settings.HANGAR_ENV_CACHE_DIR, settings.HANGAR_PIPELINE_ROOT]
    return [str(root) for root in [*roots, settings.HANGAR_CHECKPOINT_ROOT] if root]


def reachable(box: Sandbox, roots: list[str]) -> Sandbox:
    """`box` with Hangar's own directories that its uid cannot reach taken from the staging
    namespace (agent/stage.py), and the closed directories above its binds hidden (an empty
    tmpfs: bwrap makes the binds' mount points there; the job could not list them anyway)."""
    binds = all_binds(box)
    sources = []
    for bind in binds:
        blocked = reach.blocked_at(bind.path)
        if bind.ours and blocked is not None:
            root = staging_root(bind.path, blocked, roots)
            sources.append((bind.path, stage.stage().source(root) + bind.path[len(root) :]))
    closed = sorted({b for b in (reach.blocked_at(bind.path) for bind in binds) if b is not None})
    if not sources and not closed:
        return box
    hidden = (*box.hidden, *closed, *([stage.STAGE_DIR] if sources else []))
    enter = tuple(stage.stage().enter_argv()) if sources else ()
    return replace(box, hidden=hidden, sources=tuple(sources), enter=enter)


def staging_root(path: str, blocked: str, roots: list[str]) -> str:
    """The directory to stage for `path`: the innermost of Hangar's roots that holds it, below
    the closed directory `blocked` (one bind serves every job's directory); else `path` itself."""
    for root in sorted(roots, key=len, reverse=True):
        if under(path, [root]) and under(root, [blocked]) and root != blocked:
            return root
    return path


def owner_of(path: Path) -> int | None:
    """The uid an earlier attempt of this job ran as (its directory's owner): that one is not busy for it."""
    try:
        return path.stat().st_uid
    except OSError:
        return None


def hidden_paths(settings) -> tuple[str, ...]:
    from portal.models import volume_paths

    registered = volume_paths.rows()
    return (
        str(settings.DATA_DIR),
        str(settings.HANGAR_JOB_WORKDIR),
        str(settings.HANGAR_LOG_SPOOL_DIR),
        *settings.HANGAR_VOLUME_ROOTS,
        *{os.path.normpath(p) for p in registered if p.startswith("/")},
    )


def job_binds(job, env_path: Path | None = None) -> tuple[Bind, ...]:
    from jobs.pipelines import stage_env

    binds = []
    if pipeline_dir := stage_env(job).get("HANGAR_PIPELINE_DIR"):
        binds.append(Bind(os.path.normpath(pipeline_dir), writable=True, ours=True))
    environment = job.environment
    if env_path is not None:
        binds.append(Bind(os.path.normpath(env_path), ours=True))
    elif environment is not None and environment.path:
        binds.append(Bind(os.path.normpath(environment.path), ours=True))
    for volume in job.volumes:
        binds.append(Bind(os.path.normpath(volume["path"]), writable=volume.get("mode") == "rw"))
    return tuple(binds)


def start_checks() -> tuple[str, str]:
    """At the agent's start: this node's isolation (announced when less than a sandbox), with
    bwrap, setpriv and the docker client looked up once, with the agent's own PATH."""
    from django.conf import settings

    from agent.environments import JobUserError, docker_client

    isolation_mode, reason = mode()
    announce(isolation_mode, reason)
    if settings.HANGAR_JOB_USER and isolation_mode != ISOLATION_NONE:
        log.warning("HANGAR_JOB_USER is ignored: each job runs as a uid of its own (HANGAR_JOB_UID_RANGE)")
    try:
        docker_client(settings.HANGAR_DOCKER)
    except JobUserError as exc:
        log.info("container jobs cannot start here: %s", exc)
    return isolation_mode, reason


def try_as_job(command: list[str], roots: list[str], timeout: float = 60) -> tuple[int, str]:
    """Run `command` as a job would run on this node: a uid of the range, in a sandbox (or as
    that uid without one) that binds the interpreter prefixes `roots` as a job's would; its
    (exit code, output). Environments are checked this way before jobs are given them."""
    from django.conf import settings

    isolation_mode, _ = mode()
    if isolation_mode == ISOLATION_NONE:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        return done.returncode, done.stdout + done.stderr
    prepare_node(settings.DATA_DIR, settings.HANGAR_JOB_WORKDIR, sandboxed=isolation_mode == ISOLATION_SANDBOX)
    uid = job_uid(0, settings.HANGAR_JOB_UID_RANGE, uids_in_use())
    scratch = Path(tempfile.mkdtemp(prefix=".check-", dir=settings.HANGAR_JOB_WORKDIR))
    try:
        os.chown(scratch, uid, uid)
        found = tools()
        if isolation_mode == ISOLATION_SANDBOX:
            box = Sandbox(uid=uid, workdir=str(scratch), hidden=hidden_paths(settings), bwrap=found.bwrap,
                          setpriv=found.setpriv)  # fmt: skip
            box = with_interpreters(box, roots, settings)
            view, argv = view_of(box), bwrap_argv(box, command)
        else:
            view = reach.View(sandboxed=False)
            # setpriv resolves its program with root's search rights still in effect: a shell,
            # already the uid's, makes the exec a job's would be (its PATH lookup included).
            drop = [found.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
            argv = [*drop, "/bin/sh", "-c", 'exec "$0" "$@"', *command]
        first = [str(Path(command[0]).parent)] if "/" in command[0] else []
        env = {"PATH": reach.job_path(os.environ.get("PATH", os.defpath), first, view), "HOME": str(scratch)}
        done = subprocess.run(
            argv, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        return done.returncode, done.stdout + done.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 126, str(exc)
    finally:
        remove_path(scratch)


PYTHON_PROBE = "import sys; print('python', sys.version.split()[0], sys.prefix)"


def python_problem(python: str) -> tuple[str, str]:
    """(what `python` is, as a job runs it, e.g. "Python 3.11.7 at /opt/venv/bin/python"; why a
    job cannot run it, or ""): checked by running it as a job uid in a sandbox."""
    code, output = try_as_job([python, "-c", PYTHON_PROBE], reach.python_roots(python))
    said = [line for line in output.splitlines() if line.startswith("python ")]
    if code == 0 and said:
        return f"Python {said[-1].split()[1]} at {python}", ""
    tail = " ".join(output.split())[-300:] or f"exit code {code}"
    return python, f"a job's uid cannot run {python} on this node: {tail}"


def unrunnable_environments(names: list[str]) -> dict[str, str]:
    """The host environments (a virtualenv or prefix) among `names` whose Python a job uid cannot
    run on this node, with why: they are not advertised, so no job is placed here to die."""
    from jobs.models import Environment, EnvironmentKind

    refused = {}
    for environment in Environment.objects.filter(name__in=names, kind=EnvironmentKind.HOST).exclude(path=""):
        python = Path(environment.path) / "bin" / "python"
        if python.exists() and (problem := python_problem(str(python))[1]):
            refused[environment.name] = problem
    return refused
