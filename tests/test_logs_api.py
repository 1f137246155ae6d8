"""The log API: each filter alone and combined, cursor paging, follow, downloads, isolation."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Job, JobState, LogLine, Severity, Stream
from tests.factories import api_client, make_attempt, make_job, make_node

T0 = timezone.now() - timedelta(minutes=30)


def line(attempt, seq, text, node, rank=0, severity=Severity.INFO, minutes=0, stream=Stream.STDOUT, fault=False):
    return LogLine(
        job_id=attempt.job_id,
        attempt=attempt,
        node=node,
        rank=rank,
        seq=seq,
        rank_seq=seq,  # unique within the rank, as a writer numbers it
        stream=stream,
        severity=severity,
        fault=fault,
        ts=T0 + timedelta(minutes=minutes),
        text=text,
    )


@pytest.fixture
def job(project, owner):
    """Attempt 1 on node-a failed; attempt 2 runs ranks 0 (node-a) and 1 (node-b)."""
    node_a, node_b = make_node("node-a"), make_node("node-b")
    job = make_job(project, owner, nodes=2)
    first = make_attempt(job, node_a, "failed")
    second = make_attempt(job, node_a, "running")
    LogLine.objects.bulk_create(
        [
            line(first, 1, "booting", node_a),
            line(first, 2, "ERROR: Out of memory", node_a, severity=Severity.ERROR, minutes=1),
            line(second, 1, "step 1 loss=0.9", node_a, minutes=20),
            line(second, 2, "step 1 loss=0.9", node_b, rank=1, minutes=20),
            line(second, 3, "slow allreduce", node_b, rank=1, severity=Severity.WARNING, minutes=21),
            line(second, 4, "NCCL WARN net down", node_b, rank=1, severity=Severity.WARNING, minutes=22, fault=True),
            line(second, 5, "step 2 LOSS=0.5", node_a, minutes=29),
            line(second, 6, "CRITICAL: gone", node_a, severity=Severity.CRITICAL, minutes=29, stream=Stream.STDERR),
        ]
    )
    return job


def texts(response) -> list[str]:
    assert response.status_code == 200, response.content
    return [item["text"] for item in response.json()["lines"]]


def get_logs(user, job, **params):
    return api_client(user).get(f"/api/v1/jobs/{job.pk}/logs/", params)


ALL = ["booting", "ERROR: Out of memory", "step 1 loss=0.9", "step 1 loss=0.9", "slow allreduce"]
ALL += ["NCCL WARN net down", "step 2 LOSS=0.5", "CRITICAL: gone"]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, ALL),
        ({"attempt": 1}, ALL[:2]),
        ({"node": "node-b"}, ALL[3:6]),
        ({"node": "node-a,node-b"}, ALL),
        ({"rank": "1"}, ALL[3:6]),
        ({"severity": "warning"}, [ALL[1], *ALL[4:6], ALL[7]]),
        ({"severity": "ERROR"}, [ALL[1], ALL[7]]),
        ({"since": (T0 + timedelta(minutes=21)).isoformat()}, ALL[4:]),
        ({"until": (T0 + timedelta(minutes=1)).isoformat()}, ALL[:2]),
        ({"last_minutes": "5"}, ALL[6:]),
        ({"q": "loss"}, ALL[2:4] + [ALL[6]]),
        ({"q": r"loss=0\.[5-8]", "regex": "1"}, [ALL[6]]),
        ({"attempt": 2, "node": "node-a", "severity": "INFO", "q": "loss"}, [ALL[2], ALL[6]]),
        ({"node": "node-b", "severity": "WARNING", "q": "nccl"}, [ALL[5]]),
    ],
)
def test_each_filter_alone_and_combined(owner, job, params, expected):
    assert texts(get_logs(owner, job, **params)) == expected


def test_text_matches_are_highlighted(owner, job):
    lines = get_logs(owner, job, q="loss").json()["lines"]

    assert [item["hl"] for item in lines] == [[[7, 11]], [[7, 11]], [[7, 11]]]


def test_lines_carry_every_field(owner, job):
    first = get_logs(owner, job, limit=1).json()["lines"][0]

    fields = {"attempt", "attempt_number", "seq", "ts", "node", "rank", "stream", "severity", "fault", "text"}
    assert set(first) == fields
    assert (first["attempt_number"], first["seq"], first["node"], first["stream"]) == (1, 1, "node-a", "stdout")


def test_cursor_paging_gives_every_line_once(owner, job):
    seen, cursor, more = [], {"attempt": 0, "seq": 0}, True
    while more:
        page = get_logs(owner, job, limit=3, after_attempt=cursor["attempt"], after_seq=cursor["seq"]).json()
        seen += [item["text"] for item in page["lines"]]
        cursor, more = page["cursor"], page["more"]

    assert seen == ALL


def test_a_filtered_read_moves_the_cursor_past_lines_that_do_not_match(owner, job):
    page = get_logs(owner, job, severity="CRITICAL").json()
    last = job.attempts.get(number=2)

    assert page["cursor"] == {"attempt": last.pk, "seq": 6}
    assert page["more"] is False and page["final"] is False


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"severity": "LOUD"}, "severity"),
        ({"since": "yesterday"}, "since"),
        ({"q": "(", "regex": "1"}, "q"),
        ({"rank": "x"}, "rank"),
        ({"last_minutes": "-1"}, "last_minutes"),
    ],
)
def test_a_bad_filter_names_the_field(owner, job, params, field):
    response = get_logs(owner, job, **params)

    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == field


def test_follow_returns_final_once_the_job_ended(owner, job):
    Job.objects.filter(pk=job.pk).update(state=JobState.FAILED)
    last = job.attempts.get(number=2)

    page = get_logs(owner, job, follow=1, wait=5, after_attempt=last.pk, after_seq=6).json()

    assert page["lines"] == [] and page["final"] is True


def test_follow_waits_then_answers_empty_while_nothing_new(owner, job):
    last = job.attempts.get(number=2)

    page = get_logs(owner, job, follow=1, wait=1, after_attempt=last.pk, after_seq=6).json()

    assert page["lines"] == [] and page["final"] is False
    assert page["cursor"] == {"attempt": last.pk, "seq": 6}


def download(user, job, **params):
    response = api_client(user).get(f"/api/v1/jobs/{job.pk}/logs/download/", params)
    assert response.status_code == 200, response
    return b"".join(response.streaming_content).decode()


@pytest.mark.parametrize("params", [{}, {"node": "node-b"}, {"severity": "WARNING", "q": "n"}])
def test_the_jsonl_download_equals_the_filtered_view(owner, job, params):
    body = download(owner, job, **params, **{"as": "jsonl"})

    view = [{k: v for k, v in item.items() if k != "hl"} for item in get_logs(owner, job, **params).json()["lines"]]
    assert [json.loads(row) for row in body.splitlines()] == view


def test_the_text_download_has_one_line_per_log_line(owner, job):
    body = download(owner, job, node="node-b")

    rows = body.splitlines()
    assert len(rows) == 3
    assert rows[0].endswith(" node-b r1 stdout INFO step 1 loss=0.9")
    assert rows[2].endswith("WARNING NCCL WARN net down")


def test_the_download_streams_in_chunks(owner, job, monkeypatch):
    from jobs.api import logs

    monkeypatch.setattr(logs, "DOWNLOAD_CHUNK", 3)
    response = api_client(owner).get(f"/api/v1/jobs/{job.pk}/logs/download/", {"as": "jsonl"})

    chunks = list(response.streaming_content)
    assert [chunk.count(b"\n") for chunk in chunks] == [3, 3, 2]


def test_an_unknown_download_format_is_refused(owner, job):
    response = api_client(owner).get(f"/api/v1/jobs/{job.pk}/logs/download/", {"as": "pdf"})

    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "as"


@pytest.mark.parametrize("url", ["/api/v1/jobs/{id}/logs/", "/api/v1/jobs/{id}/logs/download/"])
def test_an_outsider_gets_404_for_the_logs(outsider, other_project, job, url):
    response = api_client(outsider).get(url.format(id=job.pk))

    assert response.status_code == 404


@pytest.mark.parametrize("url", ["/api/v1/jobs/{id}/logs/", "/api/v1/jobs/{id}/logs/download/"])
def test_an_anonymous_client_gets_401_for_the_logs(job, url):
    assert api_client().get(url.format(id=job.pk)).status_code == 401


def test_a_teammate_reads_the_logs(teammate, job):
    assert texts(get_logs(teammate, job)) == ALL
