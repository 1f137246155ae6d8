"""Jobs that wait for other jobs: blocked until their dependencies end as asked."""

import pytest

from hangar import cli
from jobs import dependencies
from jobs.models import AttemptState, FailureClass, Job, JobState
from jobs.scheduler import schedule_pass
from tests.factories import api_client, make_attempt, make_job

URL = "/api/v1/jobs/"


@pytest.mark.parametrize(
    ("deps", "states", "kind", "reason"),
    [
        ([{"job": 1, "on": "succeeded"}], {1: "running"}, "waiting", "waiting for job 1 (running)"),
        ([{"job": 1, "on": "succeeded"}], {1: "succeeded"}, "met", ""),
        ([{"job": 1, "on": "succeeded"}], {1: "failed"}, "never", "job 1 failed, and this job needed it to succeed"),
        ([{"job": 1, "on": "finished"}], {1: "cancelled"}, "met", ""),
        ([{"job": 1, "on": "finished"}, {"job": 2, "on": "succeeded"}], {1: "failed", 2: "queued"}, "waiting",
         "waiting for job 2 (queued)"),
        ([{"job": 1, "on": "finished"}], {}, "never", "job 1, which it depends on, no longer exists"),
    ],
)  # fmt: skip
def test_the_verdict_on_a_jobs_dependencies(deps, states, kind, reason):
    assert dependencies.verdict(deps, states) == dependencies.Verdict(kind, reason)


def submit(user, **fields):
    body = {"project": "vision", "command": ["python", "eval.py"], **fields}
    return api_client(user).post(URL, body, format="json")


def end(job: Job, node, state: str, failure_class: str = "") -> None:
    make_attempt(job, node, AttemptState.RUNNING).finish(state, failure_class, f"ended {state}")


def test_a_job_waits_blocked_then_runs_when_its_dependency_succeeded(
    owner, project, node, django_capture_on_commit_callbacks
):
    train = make_job(project, owner, name="train", state=JobState.RUNNING)
    response = submit(owner, depends_on=[{"job": train.pk}])
    assert response.status_code == 201, response.content
    evaluate = Job.objects.get(pk=response.json()["id"])
    assert (evaluate.state, evaluate.state_reason) == (JobState.BLOCKED, f"waiting for job {train.pk} (running)")
    assert evaluate.depends_on == [{"job": train.pk, "on": "succeeded"}]

    waiting = api_client(owner).get("/api/v1/queue/").json()["waiting"]
    mine = next(row for row in waiting if row["id"] == evaluate.pk)
    assert mine["position"] is None and mine["reason"]["code"] == "blocked"
    schedule_pass()
    assert not evaluate.attempts.exists()  # never placed while blocked, though GPUs are free

    with django_capture_on_commit_callbacks(execute=True):
        end(train, node, AttemptState.SUCCEEDED)

    evaluate.refresh_from_db()
    assert evaluate.state == JobState.QUEUED and evaluate.state_reason == ""
    assert evaluate.events.filter(kind="unblocked").exists()


def test_a_failed_dependency_cancels_the_chain_and_finished_waits_for_any_end(
    owner, project, node, django_capture_on_commit_callbacks
):
    train = make_job(project, owner, name="train")
    evaluate = Job.objects.get(pk=submit(owner, depends_on=[{"job": train.pk}]).json()["id"])
    report = Job.objects.get(pk=submit(owner, depends_on=[{"job": evaluate.pk}]).json()["id"])
    cleanup = Job.objects.get(pk=submit(owner, depends_on=[{"job": train.pk, "on": "finished"}]).json()["id"])

    with django_capture_on_commit_callbacks(execute=True):
        end(train, node, AttemptState.FAILED, FailureClass.USER)

    for job in (evaluate, report, cleanup):
        job.refresh_from_db()
    assert evaluate.state == JobState.CANCELLED
    assert evaluate.state_reason == f"cancelled: job {train.pk} failed, and this job needed it to succeed"
    assert report.state == JobState.CANCELLED and f"job {evaluate.pk} cancelled" in report.state_reason
    assert cleanup.state == JobState.QUEUED


def test_dependencies_are_refused_on_other_projects_unseen_and_failed_jobs(
    owner, outsider, project, other_project, node
):
    from portal.models import Membership, Role

    Membership.objects.create(project=other_project, user=owner, role=Role.VIEWER)  # it sees their jobs
    theirs = make_job(other_project, outsider)
    failed = make_job(project, owner, state=JobState.FAILED)

    cases = [
        ({"job": theirs.pk}, f"job {theirs.pk} is in project nlp; depend only on jobs of vision"),
        ({"job": 999999}, "no job 999999 that you can see"),
        ({"job": failed.pk}, f"job {failed.pk} failed, so it will never succeed; use on=finished"),
        ({"job": failed.pk, "on": "whenever"}, "whenever is not a condition; use succeeded or finished"),
    ]
    before = Job.objects.count()
    for dep, message in cases:
        response = submit(owner, depends_on=[dep])
        assert response.status_code == 400 and message in response.json()["message"], response.json()
        assert response.json()["errors"][0]["field"].startswith("depends_on[0]")
    assert Job.objects.count() == before  # nothing half-made


def test_a_blocked_job_can_be_cancelled(owner, project, node):
    train = make_job(project, owner)
    blocked = Job.objects.get(pk=submit(owner, depends_on=[{"job": train.pk}]).json()["id"])

    assert blocked.cancel(owner, "not needed")
    assert blocked.state == JobState.CANCELLED


def test_hangar_submit_after_names_the_jobs_to_wait_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HANGAR_CONFIG", str(tmp_path / "config.json"))
    args = cli.parser().parse_args(["submit", "-p", "vision", "--after", "12", "--after", "13:finished", "--", "true"])
    assert cli.job_spec(args)["depends_on"] == [{"job": 12, "on": "succeeded"}, {"job": 13, "on": "finished"}]
    bad = cli.parser().parse_args(["submit", "--after", "12:soon", "--", "true"])
    with pytest.raises(cli.HangarError, match="write JOB or JOB:finished"):
        cli.job_spec(bad)


def test_asking_a_started_job_to_stop_does_not_announce_that_it_ended(owner, project, node):
    from jobs.signals import job_ended

    heard = []
    listener = lambda sender, job, **kwargs: heard.append(job.pk)  # noqa: E731
    job_ended.connect(listener)
    try:
        running = make_job(project, owner)
        make_attempt(running, node, AttemptState.RUNNING)
        queued = make_job(project, owner, name="queued")

        assert running.cancel(owner, "stop") and running.state == JobState.RUNNING  # asked, not ended
        assert queued.cancel(owner, "not needed")
    finally:
        job_ended.disconnect(listener)
    assert heard == [queued.pk]


def test_a_projects_blocked_jobs_are_found_by_index_not_by_reading_its_history(owner, project):
    """Every job that ends reads its project's blocked jobs: that read must not grow with
    the project's history (it read every job of the project on PostgreSQL)."""
    for _ in range(3):
        make_job(project, owner, state=JobState.SUCCEEDED)
    plan = dependencies.blocked_in.build(project_id=project.pk).explain()
    assert "job_state_project" in plan, plan
