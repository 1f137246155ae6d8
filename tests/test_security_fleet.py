"""A node's health events, checks and cordon history show another project's printed
line and job ids only to that project's members and staff (fleet/evidence.py)."""

import pytest
from django.test import Client

from fleet.models import HealthCheck, HealthEvent
from tests.factories import api_client, make_attempt, make_job, make_user

SECRET = "loss=0.31 on s3://nlp-private/dataset-v7 NCCL WARN net failed"


@pytest.fixture
def leaky_node(node, other_project, outsider):
    """node-a: an event from the output of project nlp's job (outsider's), and a check run for it."""
    job = make_job(other_project, outsider)
    attempt = make_attempt(job, node, "failed")
    event = HealthEvent.objects.create(
        node=node, attempt=attempt, kind="nccl", severity="critical", message="NCCL warned of a failure",
        evidence={"line": SECRET, "decision": "corroborated"}, action="cordoned",
    )  # fmt: skip
    HealthCheck.objects.create(node=node, attempt=attempt, name="devices", passed=True, duration_ms=3.0)
    node.auto_cordon("NCCL warned of a failure", {"health_event": event.pk, **event.evidence})
    return node, job, attempt


def page_of(user) -> str:
    client = Client()
    client.force_login(user)
    response = client.get("/fleet/nodes/node-a/")
    assert response.status_code == 200
    return response.content.decode()


def test_others_see_a_job_of_another_project_on_the_node_page(leaky_node, owner, project):
    _, job, _ = leaky_node
    page = page_of(owner)
    assert SECRET not in page
    assert f"(job {job.pk})" not in page
    assert "a job of another project" in page


def test_the_projects_members_and_staff_see_the_evidence(leaky_node, outsider):
    _, job, _ = leaky_node
    assert SECRET in page_of(outsider)
    assert f"(job {job.pk})" in page_of(outsider)
    staff = make_user("operator", is_staff=True)
    assert SECRET in page_of(staff)


def test_the_node_api_hides_others_attempts_and_output(leaky_node, owner, outsider):
    _, _, attempt = leaky_node
    events = api_client(owner).get("/api/v1/nodes/node-a/events/").json()["results"]
    assert events[0]["attempt"] is None and events[0]["other_project"] is True
    assert SECRET not in str(events) and events[0]["evidence"]["job"] == "a job of another project"
    checks = api_client(owner).get("/api/v1/nodes/node-a/checks/").json()["results"]
    assert checks[0]["attempt"] is None and checks[0]["other_project"] is True
    mine = api_client(outsider).get("/api/v1/nodes/node-a/events/").json()["results"]
    assert mine[0]["attempt"] == attempt.pk and mine[0]["evidence"]["line"] == SECRET
    assert mine[0]["other_project"] is False


def test_a_cordons_evidence_cites_other_jobs_reports_only_to_their_projects(
    node, project, owner, other_project, outsider
):
    """A cordon's evidence lists the other reports that agree with it, each with the line and the
    attempt and user it came from: those of another project are redacted too, at any depth."""
    theirs = make_attempt(make_job(other_project, outsider), node, "failed")
    mine = make_attempt(make_job(project, owner, name="mine"), node, "failed")
    cited = {"source": "output", "kind": "nccl", "line": SECRET, "attempt": theirs.pk, "user": outsider.pk}
    event = HealthEvent.objects.create(
        node=node, attempt=mine, kind="nccl", severity="critical", message="NCCL failure reported by two users",
        evidence={"line": "my own NCCL WARN line", "attempt": mine.pk, "related_events": [cited]}, action="cordoned",
    )  # fmt: skip
    node.auto_cordon("NCCL failure reported by two users", {"health_event": event.pk, **event.evidence})

    page = page_of(owner)
    events = api_client(owner).get("/api/v1/nodes/node-a/events/").json()["results"]
    assert SECRET not in page and SECRET not in str(events)
    assert "my own NCCL WARN line" in page  # its own report stays readable
    related = events[0]["evidence"]["related_events"][0]
    assert related["job"] == "a job of another project" and "attempt" not in related and "user" not in related
    assert SECRET in page_of(outsider)
