"""How a job's command runs in its environment: on the host (optionally inside a
virtualenv or interpreter prefix), or in a container through `docker run --gpus`."""

from pathlib import Path

from django.conf import settings

from jobs.models import EnvironmentKind, Job

# The agent's own variables are not the job's: the container gets only these names.
HOST_ONLY = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME", "SHELL", "CUDA_VISIBLE_DEVICES")


def command_for(job: Job, env: dict[str, str], gpus: list[int], workdir: Path, name: str):
    """The argv and environment to start for one rank of `job`."""
    environment = job.environment
    if environment is None:
        return list(job.command), env
    if environment.kind == EnvironmentKind.CONTAINER:
        names = sorted(k for k in env if k not in HOST_ONLY)
        return docker_argv(environment.image, job.command, names, gpus, workdir, name), env
    if environment.path:
        prefix = Path(environment.path)
        env = {**env, "PATH": f"{prefix / 'bin'}:{env.get('PATH', '')}", "VIRTUAL_ENV": str(prefix)}
    return list(job.command), env


def docker_argv(image: str, command: list[str], env_names: list[str], gpus: list[int], workdir: Path, name: str):
    """`docker run` for one rank: its GPUs only, the host network (ranks reach each
    other as on the host), the job's directory (checkpoints included) mounted at the
    same path. Variables go by name (`-e NAME`), so their values, secrets included,
    never appear on a command line; the docker client passes them from its environment."""
    argv = [settings.HANGAR_DOCKER, "run", "--rm", "--name", name, "--init"]
    if gpus:
        # The quotes are part of the value: docker reads --gpus as CSV, and the device list has commas.
        argv += ["--gpus", '"device={}"'.format(",".join(str(g) for g in gpus))]
    argv += ["--network", "host", "--ipc", "host", "-v", f"{workdir}:{workdir}", "-w", str(workdir)]
    for key in env_names:
        argv += ["-e", key]
    return [*argv, image, *command]
