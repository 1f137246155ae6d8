"""The queue API and page: position, reason, estimated start, moving jobs, running placements."""

from datetime import timedelta

from django.utils import timezone
from rest_framework.test import APIClient

from jobs.models import AttemptState, Job
from tests.factories import api_client, make_attempt, make_job, make_node

URL = "/api/v1/queue/"


def waiting(user, **params) -> list[dict]:
    response = api_client(user).get(URL, params)
    assert response.status_code == 200, response.content
    return response.json()["waiting"]


def test_waiting_jobs_have_a_position_a_reason_and_an_estimated_start(project, owner, node):
    running = make_job(project, owner, gpus_per_node=4, max_runtime_seconds=600)
    make_attempt(running, node, AttemptState.RUNNING, gpu_indices=[0, 1, 2, 3], running_at=timezone.now())
    big = make_job(project, owner, gpus_per_node=4, max_runtime_seconds=300)
    gang = make_job(project, owner, gpus_per_node=4, nodes=2)
    alien = make_job(project, owner, gpu_type="B300")

    rows = {row["id"]: row for row in waiting(owner)}

    assert [rows[j.pk]["position"] for j in (big, gang, alien)] == [1, 2, 3]
    assert rows[big.pk]["reason"]["code"] == "capacity"
    assert "4 x any GPU on one node" in rows[big.pk]["reason"]["message"]
    assert rows[gang.pk]["reason"]["code"] == "gpu_type"  # one node of 4 GPUs cannot hold a 2-node gang
    assert rows[alien.pk]["reason"] == {"code": "gpu_type", "message": "no ready node has B300 GPUs"}
    start = timezone.datetime.fromisoformat(rows[big.pk]["estimated_start"].replace("Z", "+00:00"))
    assert timedelta(seconds=590) < start - timezone.now() < timedelta(seconds=610)
    assert rows[alien.pk]["estimated_start"] is None


def test_a_job_that_fits_now_says_it_is_starting(project, owner, node):
    job = make_job(project, owner)

    (row,) = waiting(owner)

    assert (row["id"], row["reason"]["code"]) == (job.pk, "starting")


def test_running_jobs_show_their_placement(project, owner, node):
    b = make_node("node-b")
    job = make_job(project, owner, nodes=2)
    placement = [
        {"rank": 0, "node_id": node.pk, "node": "node-a", "gpus": [0]},
        {"rank": 1, "node_id": b.pk, "node": "node-b", "gpus": [2]},
    ]
    make_attempt(job, node, AttemptState.RUNNING, placement=placement)

    (row,) = api_client(owner).get(URL).json()["running"]

    assert row["id"] == job.pk
    assert [(r["node"], r["gpus"]) for r in row["placement"]] == [("node-a", [0]), ("node-b", [2])]


def test_an_outsider_sees_none_of_the_projects_queue(project, owner, outsider, other_project, node):
    make_job(project, owner)

    assert waiting(outsider) == []
    assert APIClient().get(URL).status_code in (401, 403)


def test_positions_count_jobs_the_user_cannot_see(project, other_project, owner, outsider, node):
    make_job(other_project, outsider, priority="high", gpus_per_node=4)
    mine = make_job(project, owner, gpus_per_node=4)

    (row,) = waiting(owner)

    assert (row["id"], row["position"]) == (mine.pk, 2)


def move(user, job: Job, direction: str):
    return api_client(user).post(f"/api/v1/jobs/{job.pk}/move/", {"direction": direction}, format="json")


def test_a_submitter_moves_a_job_up_within_its_class(project, teammate):
    first, second = make_job(project, teammate), make_job(project, teammate)
    make_node(gpus=1)
    make_job(project, teammate, priority="high")

    response = move(teammate, second, "up")

    assert response.status_code == 200 and response.json()["moved"]
    order = [row["id"] for row in waiting(teammate)]
    assert order.index(second.pk) < order.index(first.pk)
    assert move(teammate, second, "up").json()["moved"] is False  # first in its class already


def test_a_member_cannot_move_someone_elses_job_but_a_manager_can(project, owner, teammate, node):
    theirs, mine = make_job(project, owner), make_job(project, teammate)

    assert move(teammate, theirs, "down").status_code == 403
    assert move(owner, mine, "up").json()["moved"] is True


def test_an_outsider_cannot_move_a_job(project, owner, outsider, other_project):
    job = make_job(project, owner)

    assert move(outsider, job, "up").status_code == 404


def test_moving_needs_a_direction(project, owner):
    response = move(owner, make_job(project, owner), "sideways")

    assert response.status_code == 400
    assert "must be 'up' or 'down'" in response.json()["message"]


def test_the_queue_page_shows_reasons_and_moves_with_htmx(client, project, owner, teammate, node):
    client.force_login(owner)
    first, second = make_job(project, owner, gpu_type="B300"), make_job(project, teammate, gpu_type="B300")

    page = client.get("/jobs/queue/")
    assert page.status_code == 200
    assert "no ready node has B300 GPUs" in page.content.decode()

    swapped = client.post(f"/jobs/{second.pk}/move/", {"direction": "up"}, HTTP_HX_REQUEST="true")
    assert swapped.status_code == 200
    body = swapped.content.decode()
    assert body.index(f"/jobs/{second.pk}/") < body.index(f"/jobs/{first.pk}/")


def test_the_queue_page_hides_other_projects(client, project, owner, outsider, other_project, node):
    job = make_job(project, owner, name="secret-run")
    client.force_login(outsider)

    assert "secret-run" not in client.get("/jobs/queue/").content.decode()
    assert client.post(f"/jobs/{job.pk}/move/", {"direction": "up"}).status_code == 404


def test_the_job_page_shows_every_ranks_node(client, project, owner, node):
    b = make_node("node-b")
    job = make_job(project, owner, nodes=2)
    placement = [
        {"rank": 0, "node_id": node.pk, "node": "node-a", "gpus": [0]},
        {"rank": 1, "node_id": b.pk, "node": "node-b", "gpus": [3]},
    ]
    make_attempt(job, node, AttemptState.RUNNING, placement=placement)
    client.force_login(owner)

    body = client.get(f"/jobs/{job.pk}/").content.decode()

    assert "rank 0: node-a" in body and "rank 1: node-b" in body


def test_a_job_waiting_on_cordoned_nodes_says_which_and_why(project, owner, node):
    make_node("node-b", gpus=4).cordon(owner, "Xid 79 on GPU 2")
    node.drain(owner, "fan swap")
    job = make_job(project, owner)
    alien = make_job(project, owner, gpu_type="B300")

    rows = {row["id"]: row for row in waiting(owner)}

    reason = rows[job.pk]["reason"]
    assert reason["code"] == "no_ready_node"
    assert reason["message"] == (
        "no node is ready: 2 that could are not ready (1 cordoned, 1 draining): "
        "node-a draining: fan swap; node-b cordoned: Xid 79 on GPU 2"
    )
    assert "  " not in reason["message"]
    assert rows[alien.pk]["reason"] == {"code": "gpu_type", "message": "no ready node has B300 GPUs"}
