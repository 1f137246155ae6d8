"""Where a sandbox finds what its job uid cannot reach: a private mount namespace, kept by one
holder process per agent process, in which Hangar binds those directories under STAGE_DIR.

bwrap runs as the job's uid (agent/sandbox.py) and resolves every bind source as that uid, so
a Python under /root (pyenv, mode 0700) or a data directory in a clone under /root cannot be
bound, however it is named (bwrap's --bind-fd resolves the descriptor's path again). Here root
binds such a directory (the node's interpreters, the job workdir root, the environment cache)
once, at STAGE_DIR/<key> inside the holder's namespace; a sandbox that needs one starts in that
namespace (nsenter: one exec more) and binds from there. The host's mount table never changes:
the namespace receives the host's mounts (slave) and sends none, and ends with its holder,
whose stdin is a pipe only this process holds. The sandbox hides STAGE_DIR itself.
"""

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading

log = logging.getLogger("hangar.agent")

STAGE_DIR = "/run/hangar-stage"  # an empty directory on the host; a tmpfs in the holder's namespace
HOLDER_SCRIPT = 'mount -t tmpfs -o mode=0755,size=64k hangar-stage "$0" && echo ready && read -r _'


class StageUnavailable(OSError):
    """The namespace cannot be made (no unshare/nsenter, not root): what cannot be reached stays so."""


def key_of(path: str) -> str:
    return hashlib.sha256(path.encode()).hexdigest()[:16]


class Stage:
    def __init__(self, stage_dir: str = STAGE_DIR):
        self.stage_dir = stage_dir
        self.holder: subprocess.Popen | None = None
        self.staged: dict[str, str] = {}  # a host directory (path, device, inode) -> where the namespace shows it
        self.lock = threading.Lock()

    def source(self, root: str) -> str:
        """Where, inside the namespace, job uids reach the host directory `root` (bound on first
        use, and again when `root` was removed and made anew since: a bind holds the old one)."""
        info = os.stat(root)
        which = f"{root}\0{info.st_dev}\0{info.st_ino}"
        with self.lock:
            if not self.alive():
                self.start()
            if which not in self.staged:
                self.staged[which] = self.bind(root, key_of(which))
            return self.staged[which]

    def enter_argv(self) -> list[str]:
        """What a sandbox's argv starts with to run inside the namespace."""
        with self.lock:
            if not self.alive():
                self.start()
            return [nsenter(), f"--mount=/proc/{self.holder.pid}/ns/mnt", "--"]

    def alive(self) -> bool:
        return self.holder is not None and self.holder.poll() is None

    def start(self) -> None:
        if os.geteuid() != 0:
            raise StageUnavailable("only root can make the sandboxes' staging namespace")
        unshare = shutil.which("unshare")
        if unshare is None or shutil.which("nsenter") is None:
            raise StageUnavailable("unshare and nsenter (util-linux) are missing: apt-get install util-linux")
        os.makedirs(self.stage_dir, mode=0o755, exist_ok=True)
        self.staged.clear()  # a new holder: a new namespace, nothing bound yet
        self.holder = subprocess.Popen(
            [unshare, "--mount", "--propagation", "slave", "--", "sh", "-c", HOLDER_SCRIPT, self.stage_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C meant for the agent's terminal does not end it first
        )
        if self.holder.stdout.readline().strip() != b"ready":
            self.holder.wait()
            error = self.holder.stderr.read().decode(errors="replace").strip()
            self.holder = None
            raise StageUnavailable(f"the sandboxes' staging namespace did not start: {error or 'no reason given'}")

    def bind(self, root: str, key: str) -> str:
        target = f"{self.stage_dir}/{key}"
        script = 'mkdir -p "$2" && mount --rbind "$1" "$2"'
        argv = [nsenter(), f"--mount=/proc/{self.holder.pid}/ns/mnt", "--", "sh", "-c", script, "bind", root, target]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            said = " ".join(done.stderr.split()) or f"exit code {done.returncode}"
            raise StageUnavailable(f"could not stage {root} for job uids: {said}")
        log.info("sandbox: %s staged for job uids at %s", root, target)
        return target


@functools.cache
def nsenter() -> str:
    """Looked up once, with the agent's own PATH (every sandboxed start that stages runs it)."""
    found = shutil.which("nsenter")
    if found is None:
        raise StageUnavailable("nsenter (util-linux) is missing: apt-get install util-linux")
    return found


_stage = Stage()


def stage() -> Stage:
    """This process's stage: its holder starts on first use and ends with the process."""
    return _stage
