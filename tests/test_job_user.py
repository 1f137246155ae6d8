"""Jobs run as HANGAR_JOB_USER when the agent runs as root: the job's own uid, its own
directories, and a clear failure when the user is missing or cannot reach them."""

import os
import pwd
import shutil
import tempfile
from pathlib import Path

import pytest
from django.utils import timezone

from agent import runner as execution
from agent.environments import JobUser, docker_argv
from fleet.models import GPU
from jobs import scheduler
from jobs.models import AttemptState, Job, LogLine
from tests.factories import make_job, make_node

as_root = pytest.mark.skipif(os.getuid() != 0, reason="dropping to another user needs the agent to run as root")


@pytest.fixture
def job_user(settings):
    """`nobody` as the job user, with a work directory it can reach (the test data dir is private)."""
    root = Path(tempfile.mkdtemp(prefix="hangar-jobs-"))
    root.chmod(0o755)
    settings.HANGAR_JOB_WORKDIR = root
    settings.HANGAR_JOB_USER = "nobody"
    settings.HANGAR_JOB_UID_RANGE = None  # the subject: jobs as one named user, not a uid of their own
    yield pwd.getpwnam("nobody")
    shutil.rmtree(root)


def run_one(job: Job):
    node = make_node("node-a", gpus=1)
    GPU.objects.filter(node=node).update(temperature_c=35, sampled_at=timezone.now())
    (attempt,) = scheduler.schedule_pass()
    execution.run_attempt(attempt.pk)
    attempt.refresh_from_db()
    return attempt, list(LogLine.objects.filter(attempt=attempt).order_by("seq").values_list("text", flat=True))


@as_root
def test_a_job_runs_as_the_configured_user_and_owns_its_checkpoint_dir(transactional_db, project, owner, job_user):
    script = 'id -u; touch "$HANGAR_CHECKPOINT_DIR/step-1" && echo wrote; echo "user=$USER"'
    job = make_job(project, owner, command=["/bin/sh", "-c", script])  # the user's own argv, no portal shell

    attempt, lines = run_one(job)

    assert attempt.state == AttemptState.SUCCEEDED, attempt.reason
    assert str(job_user.pw_uid) in lines and "wrote" in lines and "user=nobody" in lines
    assert (job.checkpoint_dir() / "step-1").stat().st_uid == job_user.pw_uid


@as_root
def test_a_work_directory_the_user_cannot_reach_fails_the_attempt_saying_why(
    transactional_db, project, owner, job_user, settings
):
    private = Path(tempfile.mkdtemp(prefix="hangar-private-"))  # mode 0700, owned by root
    settings.HANGAR_JOB_WORKDIR = private / "jobs"
    job = make_job(project, owner, command=["/bin/true"])

    attempt, _ = run_one(job)
    shutil.rmtree(private)

    assert attempt.state == AttemptState.FAILED
    assert f"job user nobody cannot reach {private}" in attempt.reason


def test_a_missing_job_user_fails_the_attempt_instead_of_running_as_the_agent(
    transactional_db, project, owner, settings
):
    settings.HANGAR_JOB_USER = "no-such-user-here"
    settings.HANGAR_JOB_UID_RANGE = None  # the subject: jobs as one named user
    job = make_job(project, owner, command=["/bin/sh", "-c", "echo ran"])

    attempt, lines = run_one(job)

    assert attempt.state == AttemptState.FAILED and "ran" not in lines
    assert attempt.failure_class == "infra"  # the node's setting, never the user's
    assert "HANGAR_JOB_USER='no-such-user-here' is no user on this node" in attempt.reason


def test_a_container_job_runs_as_the_user_through_docker_run_user():
    user = JobUser("hangar-job", 1500, 1500, (1500, 44), "/home/hangar-job")

    argv = docker_argv("pytorch:latest", ["python", "train.py"], ["KEY"], [0], Path("/w"), "hangar-1-0", user)

    assert argv[argv.index("--user") + 1] == "1500:1500"
    assert argv[argv.index("--group-add") + 1] == "44" and argv.count("--group-add") == 1
