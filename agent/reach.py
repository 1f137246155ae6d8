"""What a job's uid can reach: the interpreters it runs from, its PATH, and its program.

A job runs as a uid of its own that owns nothing on the host but its directories, so it
passes a directory only through its "others" search bit: a Python under /root (pyenv, 0700)
or in a clone's .venv under /tmp (private in the sandbox) is out of its reach unless the
sandbox binds it (agent/sandbox.py, agent/stage.py). These functions decide, with the file
system as it is, what the job will see: the sandbox's binds, the job's PATH (never a
directory it cannot read), and whether its program can start there at all (a launch that
cannot work is refused before it starts, as the node's fault where it is the node's).
"""

import functools
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

# Programs whose absence is the node's to fix, not the job's: a missing interpreter.
INTERPRETER = re.compile(r"^(python[0-9.]*|pip[0-9.]*|torchrun|uv)$")


def job_can_search(path: str) -> bool:
    """Whether a uid that owns nothing here may pass through the directory `path` (one that is
    not there blocks nothing: whoever uses the path finds it missing, and says so)."""
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def blocked_at(path: str, start: str = "/") -> str | None:
    """The outermost directory on the way to `path` (itself excluded) that job uids cannot
    pass, from `start` (included) down: a bound directory keeps the modes inside it."""
    path, start = os.path.abspath(path), os.path.abspath(start)
    if start != "/" and not job_can_search(start):
        return start
    current = start
    for part in Path(path).relative_to(start).parts[:-1]:
        current = os.path.join(current, part)
        if not job_can_search(current):
            return current
    return None


def under(path: str, parents) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


@dataclass(frozen=True)
class View:
    """What a job sees of the host: all of it as its uid may (no sandbox), or the sandbox's
    view: `hidden` paths and /tmp empty, `bound` paths there whatever their parents."""

    sandboxed: bool
    hidden: tuple[str, ...] = ()
    bound: tuple[str, ...] = ()
    everything: bool = False  # the job runs as the agent's own user: no uid of its own

    def sees(self, path: str) -> bool:
        if self.everything:
            return True
        path = os.path.abspath(path)
        if self.sandboxed and (inside := [b for b in self.bound if under(path, [b])]):
            return blocked_at(path, start=max(inside, key=len)) is None
        if self.sandboxed and under(path, ["/tmp", *self.hidden]):
            return False
        return blocked_at(path) is None

    def enters(self, directory: str) -> bool:
        """Whether the job may look into `directory` (a PATH entry): seen, and searchable itself."""
        return self.sees(directory) and (self.everything or job_can_search(directory))


@functools.lru_cache(maxsize=64)
def python_roots(executable: str) -> tuple[str, ...]:
    """The prefixes a Python runs from: its virtualenv (if it is in one) and the installation
    the virtualenv was made from (pyvenv.cfg's home, and where bin/python links to). Read once
    per interpreter and process: every sandboxed start asks."""
    exe = Path(os.path.abspath(executable))
    prefix = exe.parent.parent
    roots = [str(prefix)]
    cfg = prefix / "pyvenv.cfg"
    if cfg.is_file():
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                roots.append(os.path.realpath(Path(value.strip()).parent))
    roots.append(str(Path(os.path.realpath(exe)).parent.parent))
    return tuple(dict.fromkeys(roots))


def prefix_roots(prefix: str) -> tuple[str, ...]:
    """The same for an environment given by its prefix (a virtualenv or an installation)."""
    for name in ("python", "python3"):
        if (Path(prefix) / "bin" / name).exists():
            return python_roots(str(Path(prefix) / "bin" / name))
    return (os.path.abspath(prefix),)


def default_python() -> str:
    """The Python a job's plain `python` is: HANGAR_JOB_PYTHON, or the agent's own (its
    virtualenv has the MLflow client, so a training script logs metrics with no set-up)."""
    from django.conf import settings

    return settings.HANGAR_JOB_PYTHON or sys.executable


def tools_to_bind(roots: list[str], view: View) -> tuple[str, ...]:
    """The interpreter prefixes a sandbox must bind: those its job would not see otherwise."""
    return tuple(root for root in roots if not view.sees(root))


def job_path(agent_path: str, first: list[str], view: View) -> str:
    """The job's PATH: `first` (its Python's bin/), then the agent's directories the job sees;
    never a directory its uid cannot read (pyenv's shims under /root: `Permission denied`)."""
    dirs = [*first, *(d for d in agent_path.split(":") if d)]
    return ":".join(d for d in dict.fromkeys(dirs) if view.enters(d))


@dataclass(frozen=True)
class Unstartable:
    """Why a job's program cannot start where it runs, and whose fault that is."""

    reason: str
    nodes_fault: bool


def own_program(program: str, workdir: str) -> bool:
    """A program in the job's own directory (`./train.sh`, its code snapshot): the job's files,
    looked at by no one but the job (root follows no link of theirs to judge them)."""
    return "/" in program and (not program.startswith("/") or under(os.path.normpath(program), [workdir]))


def program_problem(
    command: list[str], path: str, agent_path: str, view: View, node: str, workdir: str
) -> Unstartable | None:
    """Whether `command`'s program starts in the job's view, looked up on the job's PATH as
    execvp would. None when it does, or when it is the job's own (its start is then the job's
    business); else what is wrong: the node's fault when the program is on this node but out of
    the job's reach, or is an interpreter the node lacks."""
    program = command[0] if command else ""
    if not program:
        return Unstartable("the command is empty", nodes_fault=False)
    if own_program(program, workdir):
        return None
    if "/" in program:
        candidates = [program]
    else:
        candidates = [os.path.join(d, program) for d in path.split(":") if d]
    for candidate in candidates:
        if runnable(candidate, view):
            return None
    elsewhere = host_copy(program, agent_path)
    if elsewhere is not None:
        return Unstartable(
            f"{program!r} is at {elsewhere} on node {node}, which job uids cannot reach ({reach_fix(elsewhere, view)})",
            nodes_fault=True,
        )
    if INTERPRETER.match(os.path.basename(program)):
        return Unstartable(
            f"there is no {program!r} on node {node} for jobs (their PATH is {path}): set HANGAR_JOB_PYTHON "
            "to an interpreter, or give the job an environment (requirements: [...])",
            nodes_fault=True,
        )
    where = "" if "/" in program else f" on the job's PATH ({path})"
    return Unstartable(f"{program!r} is not found{where}: check the command", nodes_fault=False)


def runnable(candidate: str, view: View) -> bool:
    """An executable file the job's uid may run, through every link, in its view."""
    if not view.sees(candidate) or not os.path.isfile(candidate):
        return False
    real = os.path.realpath(candidate)
    if not view.sees(real):
        return False
    try:
        mode = os.stat(real).st_mode
    except OSError:
        return False
    return bool(mode & stat.S_IXOTH)


def host_copy(program: str, agent_path: str) -> str | None:
    """Where the program is on this node, for the agent (root): looked up on the agent's PATH."""
    if "/" in program:
        return program if os.path.isfile(program) else None
    for directory in agent_path.split(":"):
        candidate = os.path.join(directory, program)
        if directory and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def reach_fix(path: str, view: View) -> str:
    blocked = blocked_at(os.path.realpath(path)) or blocked_at(path)
    if view.sandboxed and under(path, ["/tmp"]):
        return "the sandbox's /tmp is its own: set HANGAR_JOB_PYTHON to a Python outside /tmp"
    if blocked:
        return f"{blocked} is closed to other users: set HANGAR_JOB_PYTHON to an interpreter outside it"
    return "it is hidden from jobs: set HANGAR_JOB_PYTHON to an interpreter outside Hangar's directories"
