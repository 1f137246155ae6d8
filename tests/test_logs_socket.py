"""The log websocket: subscribe with filters and a cursor, live lines through the same
filters, resubscribe, resume after a dropped connection, first error, isolation."""

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async

from jobs.models import JobState, LogLine, Severity
from tests.factories import make_attempt, make_job, make_node
from tests.test_access import LogSocket, bearer, close_code
from tests.test_logs_api import line

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def job(project, owner):
    node_a, node_b = make_node("node-a"), make_node("node-b")
    job = make_job(project, owner, nodes=2)
    attempt = make_attempt(job, node_a, "running")
    LogLine.objects.bulk_create(
        [
            line(attempt, 1, "a: step 1", node_a),
            line(attempt, 2, "b: step 1", node_b, rank=1),
            line(attempt, 3, "b: slow link", node_b, rank=1, severity=Severity.WARNING),
            line(attempt, 4, "a: step 2", node_a),
        ]
    )
    job.attempt = attempt
    job.nodes_by_name = {"node-a": node_a, "node-b": node_b}
    return job


def add_lines(job, start: int, texts: list[tuple[str, str, int]]):
    """Store lines (text, node name, severity) after seq `start`."""
    LogLine.objects.bulk_create(
        [
            line(job.attempt, start + i, text, job.nodes_by_name[node], rank=int(node == "node-b"), severity=sev)
            for i, (text, node, sev) in enumerate(texts, start=1)
        ]
    )


async def read_until(socket: LogSocket, kind: str, limit: int = 20) -> list[dict]:
    """Messages up to and including the first of type `kind`."""
    received = []
    for _ in range(limit):
        message = await socket.receive_json()
        received.append(message)
        if message["type"] == kind:
            return received
    raise AssertionError(f"no {kind} message in {received}")


def texts_of(messages: list[dict]) -> list[str]:
    return [item["text"] for m in messages if m["type"] == "lines" for item in m["lines"]]


def test_filters_in_the_url_apply_to_history_and_to_live_lines(job, owner):
    headers = bearer(owner)

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{job.pk}/logs/?node=node-b&severity=INFO", headers)
        assert (await socket.connect())[0]
        history = await read_until(socket, "state")
        await database_sync_to_async(add_lines)(
            job, 4, [("a: step 3", "node-a", Severity.INFO), ("b: step 3", "node-b", Severity.INFO)]
        )
        live = await read_until(socket, "lines")
        while not texts_of(live):
            live = await read_until(socket, "lines")
        await socket.disconnect()
        return history, live

    history, live = async_to_sync(scenario)()

    assert texts_of(history) == ["b: step 1", "b: slow link"]
    assert texts_of(live) == ["b: step 3"]
    assert live[-1]["cursor"] == {"attempt": job.attempt.pk, "seq": 6}


def test_a_subscribe_message_replaces_the_filters_and_cursor(job, owner):
    headers = bearer(owner)

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{job.pk}/logs/", headers)
        await socket.connect()
        first = await read_until(socket, "state")
        await socket.send_input(
            {
                "type": "websocket.receive",
                "text": '{"type": "subscribe", "filters": {"severity": "WARNING", "q": "slow"}, "cursor": {}}',
            }
        )
        second = await read_until(socket, "state")
        await socket.disconnect()
        return first, second

    first, second = async_to_sync(scenario)()

    assert texts_of(first) == ["a: step 1", "b: step 1", "b: slow link", "a: step 2"]
    assert second[0]["type"] == "subscribed" and second[0]["sub"] == 2
    assert second[0]["filters"]["min_severity"] == "WARNING"
    assert texts_of(second) == ["b: slow link"]
    (lines,) = [m for m in second if m["type"] == "lines"]
    assert lines["sub"] == 2 and lines["lines"][0]["hl"] == [[3, 7]]


def test_a_bad_filter_is_answered_with_the_field_to_fix(job, owner):
    headers = bearer(owner)

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{job.pk}/logs/?severity=LOUD", headers)
        await socket.connect()
        message = await socket.receive_json()
        await socket.disconnect()
        return message

    message = async_to_sync(scenario)()

    assert message["type"] == "error" and message["field"] == "severity"


def test_a_client_that_reconnects_from_its_cursor_misses_nothing_and_sees_nothing_twice(job, owner):
    headers = bearer(owner)

    async def session(cursor: dict, stop_after: int | None) -> tuple[list[str], dict]:
        path = f"/ws/jobs/{job.pk}/logs/?after_attempt={cursor['attempt']}&after_seq={cursor['seq']}&node=node-a"
        socket = LogSocket(path, headers)
        await socket.connect()
        seen = []
        while True:
            message = await socket.receive_json()
            if message["type"] == "lines":
                seen += [item["text"] for item in message["lines"]]
                cursor = message["cursor"]
                if stop_after is not None and len(seen) >= stop_after:
                    break
            elif message["type"] == "state" and message["final"]:
                break
        await socket.disconnect()  # forced: the job is still running
        return seen, cursor

    first, cursor = async_to_sync(session)({"attempt": 0, "seq": 0}, 1)
    add_lines(job, 4, [(f"{n}: more {i}", n, Severity.INFO) for i in range(50) for n in ("node-a", "node-b")])
    job.__class__.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED)
    rest, _ = async_to_sync(session)(cursor, None)

    assert first + rest == ["a: step 1", "a: step 2"] + [f"node-a: more {i}" for i in range(50)]


def test_the_first_error_of_an_attempt_is_announced_with_a_telemetry_link(job, owner):
    add_lines(job, 4, [("Traceback (most recent call last):", "node-b", Severity.ERROR)])
    add_lines(job, 5, [("RuntimeError: x", "node-b", Severity.ERROR)])

    headers = bearer(owner)

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{job.pk}/logs/?node=node-a", headers)
        await socket.connect()
        messages = await read_until(socket, "state")
        await socket.disconnect()
        return messages

    messages = async_to_sync(scenario)()

    (found,) = [m for m in messages if m["type"] == "first_error"]
    assert found["line"]["seq"] == 5 and found["line"]["node"] == "node-b"
    assert found["telemetry_url"].startswith("/fleet/nodes/node-b/?at=")
    assert texts_of(messages) == ["a: step 1", "a: step 2"]


def test_an_outsider_cannot_subscribe_even_with_filters(job, outsider, other_project):
    assert close_code(f"/ws/jobs/{job.pk}/logs/?node=node-a", bearer(outsider)) == 4404


LIVE = [
    ("live a: step 3", "node-a", Severity.INFO),
    ("live b: step 3", "node-b", Severity.INFO),
    ("live b: link DOWN", "node-b", Severity.ERROR),
    ("live a: disk slow", "node-a", Severity.WARNING),
]


@pytest.mark.parametrize(
    ("query", "history", "live"),
    [
        ("node=node-a", ["a: step 1", "a: step 2"], ["live a: step 3", "live a: disk slow"]),
        ("rank=1", ["b: step 1", "b: slow link"], ["live b: step 3", "live b: link DOWN"]),
        ("severity=WARNING", ["b: slow link"], ["live b: link DOWN", "live a: disk slow"]),
        ("q=STEP", ["a: step 1", "b: step 1", "a: step 2"], ["live a: step 3", "live b: step 3"]),
        ("q=%5Elive+.%3A+(disk%7Clink)&regex=1", [], ["live b: link DOWN", "live a: disk slow"]),
        ("attempt=1&last_minutes=60", ["a: step 1", "b: step 1", "b: slow link", "a: step 2"], [t for t, _, _ in LIVE]),
        ("attempt=2", [], []),
        ("node=node-b&severity=ERROR&q=down", [], ["live b: link DOWN"]),
    ],
)
def test_each_filter_applies_to_history_and_to_live_lines(job, owner, query, history, live):
    from django.utils import timezone

    from jobs.models import LogLine

    headers = bearer(owner)
    LogLine.objects.update(ts=timezone.now())  # within "last N minutes"

    async def scenario():
        socket = LogSocket(f"/ws/jobs/{job.pk}/logs/?{query}", headers)
        await socket.connect()
        before = await read_until(socket, "state")
        await database_sync_to_async(add_lines)(job, 4, LIVE)
        await database_sync_to_async(add_lines)(job, 8, [("live end", "node-a", Severity.CRITICAL)])
        after = []
        while not any(m["type"] == "lines" and m["cursor"]["seq"] == 9 for m in after):
            after.append(await socket.receive_json())
        await socket.disconnect()
        return before, after

    before, after = async_to_sync(scenario)()

    assert texts_of(before) == history
    assert [t for t in texts_of(after) if t != "live end"] == live


def test_a_batch_of_wide_lines_goes_in_messages_under_the_bound_each_with_its_own_cursor():
    import json as _json

    from jobs.consumers import MAX_MESSAGE_BYTES, lines_messages

    lines = [{"attempt": 4, "seq": seq, "text": "x" * 1500} for seq in range(1, 3001)]
    texts = lines_messages(1, lines, {"attempt": 4, "seq": 3200})
    messages = [_json.loads(text) for text in texts]

    assert len(texts) > 1 and all(len(text.encode()) <= MAX_MESSAGE_BYTES for text in texts)
    assert [line["seq"] for m in messages for line in m["lines"]] == list(range(1, 3001))
    assert all(m["cursor"] == {"attempt": 4, "seq": m["lines"][-1]["seq"]} for m in messages[:-1])
    assert messages[-1]["cursor"] == {"attempt": 4, "seq": 3200}  # the page's, past the last line shown
    assert lines_messages(1, [], {"attempt": 4, "seq": 9}) == [
        '{"type": "lines", "sub": 1, "lines": [], "cursor": {"attempt": 4, "seq": 9}}'
    ]
