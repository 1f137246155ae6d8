"""Stragglers: time each node spent throttled during an attempt, and the node that throttled most."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from fleet.models import TelemetrySample
from jobs.models import Attempt, AttemptState
from tests.factories import make_attempt, make_job, make_node


def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def throttled(node, gpu: int, at, thermal: float = 0.0, power: float = 0.0) -> None:
    TelemetrySample.objects.create(
        node=node, gpu_index=gpu, at=at, utilization_pct=90, thermal_throttle_s=thermal, power_throttle_s=power
    )


@pytest.fixture
def two_node_attempt(project, owner):
    """A finished 2-node attempt on GPUs 0-1 of node-a (rank 0) and node-b (rank 1); node-b throttles most."""
    a, b = make_node("node-a"), make_node("node-b")
    start = timezone.now() - timedelta(minutes=10)
    job = make_job(project, owner, nodes=2, gpus_per_node=2)
    placement = [
        {"rank": 0, "node_id": a.pk, "node": "node-a", "gpus": [0, 1]},
        {"rank": 1, "node_id": b.pk, "node": "node-b", "gpus": [0, 1]},
    ]
    attempt = make_attempt(
        job,
        a,
        AttemptState.SUCCEEDED,
        gpu_indices=[0, 1],
        placement=placement,
        running_at=start,
        finished_at=start + timedelta(minutes=5),
    )
    for minute in range(5):
        at = start + timedelta(minutes=minute, seconds=30)
        throttled(a, 0, at, thermal=5)
        throttled(b, 1, at, thermal=20, power=10)
        throttled(b, 3, at, thermal=60)  # not the attempt's GPU
    throttled(b, 0, start + timedelta(minutes=7), thermal=99)  # after the attempt ended
    return job, attempt, a, b


def test_the_job_page_shows_each_nodes_throttled_time_and_flags_the_straggler(owner, two_node_attempt):
    job, attempt, a, b = two_node_attempt

    page = browser(owner).get(f"/jobs/{job.pk}/").content.decode()

    section = page[page.index('id="throttle"') :]
    section = section[: section.index("</section>")]
    rows = section.split("<tr")[2:]
    assert "node-a" in rows[0] and "25 s" in rows[0] and "straggler" not in rows[0]
    assert "node-b" in rows[1] and "100 s" in rows[1] and "50 s" in rows[1] and "straggler" in rows[1]


def test_the_node_page_flags_the_straggler_with_one_query_for_all_attempts(
    owner, two_node_attempt, django_assert_max_num_queries
):
    job, attempt, a, b = two_node_attempt
    for _ in range(10):  # more single-node attempts on node-a: the query count must not grow with them
        other = make_job(job.project, owner)
        make_attempt(
            other,
            a,
            AttemptState.SUCCEEDED,
            gpu_indices=[2],
            running_at=timezone.now() - timedelta(minutes=3),
            finished_at=timezone.now(),
        )
    client = browser(owner)

    # One of them sums every attempt's throttling; one lists the cached environments.
    with django_assert_max_num_queries(12):
        page = client.get("/fleet/nodes/node-a/").content.decode()

    row = next(r for r in page.split("<tr") if f"/jobs/{job.pk}/" in r)
    assert "25 s / 0 s" in row and "node-b" in row and "straggler" in row
    assert Attempt.objects.filter(node=a).count() == 11


def test_the_straggler_nodes_own_page_shows_the_attempt_it_ran_as_rank_one(owner, outsider, two_node_attempt):
    job, attempt, a, b = two_node_attempt

    page = browser(owner).get("/fleet/nodes/node-b/").content.decode()

    row = next(r for r in page.split("<tr") if f"/jobs/{job.pk}/" in r)
    assert "<td>0,1</td>" in row  # node-b's own GPUs
    assert "100 s / 50 s" in row and "this node" in row
    assert f"/jobs/{job.pk}/" not in browser(outsider).get("/fleet/nodes/node-b/").content.decode()


def test_no_straggler_when_no_node_throttled(owner, two_node_attempt):
    job, attempt, a, b = two_node_attempt
    TelemetrySample.objects.update(thermal_throttle_s=0, power_throttle_s=0)

    page = browser(owner).get(f"/jobs/{job.pk}/").content.decode()

    assert 'id="throttle"' in page and ">straggler<" not in page
