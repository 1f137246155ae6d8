"""How a job's command runs in its environment: on the host (optionally inside a
virtualenv or interpreter prefix), or in a container through `docker run --gpus`;
and as whom: HANGAR_JOB_USER, so that an agent running as root does not run jobs as root."""

import functools
import logging
import os
import pwd
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from agent import sandbox
from jobs.models import EnvironmentKind, Job

log = logging.getLogger("hangar.agent")

# The agent's own variables are not the job's: the container gets only these names.
HOST_ONLY = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL", "CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class JobUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


class JobUserError(OSError):
    """The job user is missing or cannot reach the job's directory. An OSError, so the
    Runner fails the attempt with this message instead of starting the job as root."""


def job_user() -> JobUser | None:
    """Who jobs run as: HANGAR_JOB_USER (a name or uid), or None for the agent's own user."""
    configured = settings.HANGAR_JOB_USER
    if not configured:
        warn_if_root()
        return None
    try:
        entry = pwd.getpwuid(int(configured)) if configured.isdigit() else pwd.getpwnam(configured)
    except KeyError:
        raise JobUserError(f"HANGAR_JOB_USER={configured!r} is no user on this node; create it or change the setting")
    if entry.pw_uid == os.getuid():
        return None
    groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


@functools.cache
def warn_if_root() -> None:
    if os.getuid() == 0:
        log.warning("the agent runs as root and HANGAR_JOB_USER is unset: jobs run as root; set HANGAR_JOB_USER")


def uid_user(uid: int) -> JobUser:
    """A job's own uid from HANGAR_JOB_UID_RANGE: no passwd entry, its own group, no others."""
    return JobUser(f"job-{uid}", uid, uid, (), "")


def is_container(job: Job) -> bool:
    return job.environment is not None and job.environment.kind == EnvironmentKind.CONTAINER


@functools.cache
def docker_client(configured: str) -> str:
    """The docker client, looked up once with the agent's own PATH: never with a job's, whose
    PATH would choose which program the agent runs (as root)."""
    found = shutil.which(configured, path=os.environ.get("PATH", os.defpath))
    if found is None:
        raise JobUserError(f"HANGAR_DOCKER={configured!r} is not on the agent's PATH; install docker or set its path")
    return os.path.abspath(found)


def client_env(env: dict[str, str]) -> dict[str, str]:
    """The docker client's own environment: the job's variables (passed on by name) with the
    agent's PATH, and no variable that changes what the client loads or which engine it talks to."""
    kept = {k: v for k, v in env.items() if not k.startswith(("DOCKER_", "LD_")) and k not in ("PATH", "HOME")}
    agent = {k: v for k, v in os.environ.items() if k.startswith("DOCKER_")}  # the agent's engine, if it set one
    # HOME too: the client reads $HOME/.docker/config.json, whose helpers and plugins it runs.
    home = {"HOME": os.environ["HOME"]} if "HOME" in os.environ else {}
    return {**kept, **agent, **home, "PATH": os.environ.get("PATH", os.defpath)}


def popen_user(job: Job, user: JobUser | None) -> dict:
    """subprocess.Popen's arguments that drop to the job user. A container's docker client
    stays the agent's (it needs the docker socket); `docker run --user` drops instead."""
    if user is None or (job.environment is not None and job.environment.kind == EnvironmentKind.CONTAINER):
        return {}
    return {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)}


def prepare_workdir(workdir: Path, checkpoints: Path, user: JobUser | None) -> None:
    """Make the job's directory (and its checkpoint directory) the job user's."""
    if user is None:
        checkpoints.mkdir(parents=True, exist_ok=True)
        return
    sandbox.prepare_job_dirs(workdir, checkpoints, user.uid, user.gid)  # by descriptor: links are never followed
    for parent in workdir.parents:
        if not may_search(parent.stat(), user):
            raise JobUserError(
                f"job user {user.name} cannot reach {parent} (no search permission); "
                "chmod o+x it or set HANGAR_JOB_WORKDIR to a directory the user can reach"
            )


def may_search(info: os.stat_result, user: JobUser) -> bool:
    if info.st_uid == user.uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid in user.groups:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def command_for(
    job: Job,
    env: dict[str, str],
    gpus: list[int],
    workdir: Path,
    name: str,
    user: JobUser | None = None,
    prefix: Path | None = None,
):
    """The argv and environment to start for one rank of `job`, as `user` when given; in the
    virtualenv `prefix` (its cached environment, agent/envcache.py) when given."""
    if user is not None:
        home = user.home if os.path.isdir(user.home) else str(workdir)
        env = {**env, "USER": user.name, "LOGNAME": user.name, "HOME": home}
    environment = job.environment
    if prefix is not None:
        return list(job.command), in_prefix(env, prefix)
    if environment is None:
        return list(job.command), env
    if environment.kind == EnvironmentKind.CONTAINER:
        names = sorted(k for k in env if k not in HOST_ONLY)
        network = getattr(job.project, "network", "host")
        argv = docker_argv(environment.image, job.command, names, gpus, workdir, name, user, job.volumes, network)
        return argv, client_env(env)
    if environment.path:
        env = in_prefix(env, Path(environment.path))
    return list(job.command), env


def in_prefix(env: dict[str, str], prefix: Path) -> dict[str, str]:
    """A virtualenv's or prefix's bin/ first on PATH: its `python` is the job's."""
    return {**env, "PATH": f"{prefix / 'bin'}:{env.get('PATH', '')}", "VIRTUAL_ENV": str(prefix)}


def docker_argv(
    image: str,
    command: list[str],
    env_names: list[str],
    gpus: list[int],
    workdir: Path,
    name: str,
    user: JobUser | None = None,
    volumes: list[dict] = (),
    network: str = "host",
    docker: str | None = None,
):
    """`docker run` for one rank: its GPUs only, the host network (ranks reach each
    other as on the host) unless the project's policy is none, the job's directory
    (checkpoints included) and its volumes (ro or rw, as declared) mounted at the same
    path, and nothing else; always as a non-root `--user`, never --privileged.
    Variables go by name (`-e NAME`), so their values, secrets included,
    never appear on a command line; the docker client passes them from its environment."""
    argv = [docker or docker_client(settings.HANGAR_DOCKER), "run", "--rm", "--name", name, "--init"]
    if gpus:
        # The quotes are part of the value: docker reads --gpus as CSV, and the device list has commas.
        argv += ["--gpus", '"device={}"'.format(",".join(str(g) for g in gpus))]
    argv += ["--network", "none" if network == "none" else "host", "--ipc", "private"]
    argv += ["--security-opt", "no-new-privileges", "-v", f"{workdir}:{workdir}", "-w", str(workdir)]
    for volume in volumes:
        path = os.path.normpath(volume["path"])
        argv += ["-v", f"{path}:{path}:{'rw' if volume.get('mode') == 'rw' else 'ro'}"]
    uid, gid, groups = (user.uid, user.gid, user.groups) if user is not None else (os.getuid(), os.getgid(), ())
    argv += ["--user", f"{uid}:{gid}"]
    argv += [a for g in groups if g != gid for a in ("--group-add", str(g))]
    for key in env_names:
        argv += ["-e", key]
    return [*argv, image, *command]
