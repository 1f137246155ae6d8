"""Environments: where a job may run and the command line its rank starts with."""

import os
import shutil
from pathlib import Path

from agent.environments import JobUser, command_for, docker_argv
from agent.runner import rank_env
from jobs.models import Attempt, Environment, EnvironmentKind
from tests.factories import make_job, make_node


def test_the_docker_command_line_for_a_rank():
    user = JobUser("job-200007", 200007, 200007, (), "")
    volumes = [
        {"name": "imagenet", "path": "/data/imagenet", "mode": "ro"},
        {"name": "out", "path": "/out/", "mode": "rw"},
    ]
    argv = docker_argv("nvcr.io/nvidia/pytorch:25.01-py3", ["python", "train.py", "--lr", "1e-4"],
                       ["HANGAR_JOB_ID", "WANDB_API_KEY"], [2, 3], Path("/data/jobs/7"), "hangar-70-1",
                       user, volumes, "host", docker="/usr/bin/docker")  # fmt: skip

    assert argv == [
        "/usr/bin/docker", "run", "--rm", "--name", "hangar-70-1", "--init",
        "--gpus", '"device=2,3"',
        "--network", "host", "--ipc", "private", "--security-opt", "no-new-privileges",
        "-v", "/data/jobs/7:/data/jobs/7", "-w", "/data/jobs/7",
        "-v", "/data/imagenet:/data/imagenet:ro", "-v", "/out:/out:rw",
        "--user", "200007:200007",
        "-e", "HANGAR_JOB_ID", "-e", "WANDB_API_KEY",
        "nvcr.io/nvidia/pytorch:25.01-py3", "python", "train.py", "--lr", "1e-4",
    ]  # fmt: skip


def test_a_container_job_passes_variables_by_name_never_their_values(project, owner, settings):
    settings.HANGAR_DOCKER = "sh"  # any program on the agent's PATH stands in for the client
    image = Environment.objects.create(name="pt", kind=EnvironmentKind.CONTAINER, image="pytorch:latest")
    job = make_job(project, owner, environment=image)
    env = {"PATH": "/job/bin", "CUDA_VISIBLE_DEVICES": "0", "SECRET": "hunter2", "RANK": "0", "LD_PRELOAD": "/x.so"}

    argv, passed = command_for(job, env, [0], Path("/w"), "hangar-1-0")

    assert argv[0] == shutil.which("sh", path=os.environ["PATH"]) and argv[1] == "run"  # found with the agent's PATH
    assert argv[-3:] == ["pytorch:latest", "python", "train.py"]
    assert "hunter2" not in " ".join(argv)
    assert ["-e", "RANK"] == argv[argv.index("RANK") - 1 : argv.index("RANK") + 1]
    assert "PATH" not in argv and "CUDA_VISIBLE_DEVICES" not in argv  # the container sees only its GPUs
    assert "--privileged" not in argv and argv[argv.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    # The docker client hands the values over, with the agent's PATH and nothing that changes what it loads.
    assert passed["SECRET"] == "hunter2" and passed["RANK"] == "0"
    assert passed["PATH"] == os.environ["PATH"] and "LD_PRELOAD" not in passed


def test_a_host_environment_puts_its_prefix_first_on_path(project, owner):
    venv = Environment.objects.create(name="venv", path="/opt/envs/ai")
    job = make_job(project, owner, environment=venv)

    argv, env = command_for(job, {"PATH": "/usr/bin"}, [0], Path("/w"), "x")

    assert argv == ["python", "train.py"]
    assert env["PATH"] == "/opt/envs/ai/bin:/usr/bin" and env["VIRTUAL_ENV"] == "/opt/envs/ai"


def test_a_job_without_an_environment_runs_its_command_as_is(project, owner):
    argv, env = command_for(make_job(project, owner), {"A": "1"}, [0], Path("/w"), "x")

    assert (argv, env) == (["python", "train.py"], {"A": "1"})


def test_built_in_environments_exist(db):
    assert dict(Environment.objects.values_list("name", "everywhere")) == {"cuda": True, "ai": True}


def test_the_ai_environment_is_a_cached_one_built_on_demand(db):
    ai = Environment.objects.get(name="ai")

    assert ai.cached and ai.requirements == ["torch", "transformers"] and not ai.path


def test_a_node_advertises_its_environments(db):
    node = make_node()
    Environment.objects.create(name="old")
    Environment.objects.get(name="old").nodes.add(node)

    unknown = Environment.advertise(node, ["ai", "nope"])

    assert unknown == ["nope"]
    assert list(node.environments.values_list("name", flat=True)) == ["ai"]


def test_ranks_get_torchrun_style_variables(project, owner):
    a, b = make_node("node-a"), make_node("node-b")
    job = make_job(project, owner, nodes=2, gpus_per_node=4)
    placement = [{"rank": 0, "node_id": a.pk, "gpus": [0]}, {"rank": 1, "node_id": b.pk, "gpus": [0]}]
    attempt = Attempt.objects.create(job=job, number=1, node=a, placement=placement, queued_at=job.queued_at)

    env = rank_env(attempt, 1, "gpu-host-a")

    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "gpu-host-a"
    assert (env["WORLD_SIZE"], env["RANK"], env["NODE_RANK"], env["LOCAL_RANK"]) == ("2", "1", "1", "0")
    assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == str(29500 + attempt.pk % 1000)
    assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("2", "1", "4")


def test_every_rank_is_told_rank_0s_host_as_master(project, owner):
    from agent.runner import Runner

    a, b = make_node("node-a", hostname="gpu-host-a"), make_node("node-b", hostname="gpu-host-b")
    job = make_job(project, owner, nodes=2, gpus_per_node=1)
    placement = [{"rank": 0, "node_id": a.pk, "gpus": [0]}, {"rank": 1, "node_id": b.pk, "gpus": [2]}]
    attempt = Attempt.objects.create(job=job, number=1, node=a, placement=placement, queued_at=job.queued_at)

    second = Runner(Attempt.objects.select_related("job__project", "node").get(pk=attempt.pk), rank=1)

    assert (second.node.name, second.gpus) == ("node-b", [2])  # it runs on its own node ...
    assert second.job_env()["MASTER_ADDR"] == "gpu-host-a"  # ... and meets rank 0 on rank 0's


def test_a_rank_that_aborts_at_exit_gets_the_barrier_hint():
    from agent.runner import abort_hint

    assert "dist.barrier()" in abort_hint(-6, world_size=2)
    assert "dist.barrier()" in abort_hint(134, world_size=2)
    assert abort_hint(-6, world_size=1) == "" and abort_hint(1, world_size=2) == ""


def test_the_built_in_environments_come_back_after_a_flush(transactional_db):
    """A flush (what a transactional test leaves behind, or an operator's) empties the table the
    migrations seeded; its post_migrate brings the built-ins back, so no later job or test finds none."""
    from django.core.management import call_command

    call_command("flush", interactive=False, verbosity=0)

    assert dict(Environment.objects.values_list("name", "everywhere")) == {"cuda": True, "ai": True}
    assert Environment.objects.get(name="ai").requirements == ["torch", "transformers"]
