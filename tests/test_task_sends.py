"""Tasks sent by name (portal/celery.py): their results are never read, so a send asks the
result backend for nothing (on Redis, a subscription to the result's channel per message)."""

from portal.celery import app, ping


def calls_to_the_result_backend(monkeypatch) -> list[str]:
    calls = []
    monkeypatch.setattr(app.backend, "on_task_call", lambda producer, task_id: calls.append(task_id))
    return calls


def test_a_task_sent_by_name_asks_the_result_backend_for_nothing(monkeypatch):
    calls = calls_to_the_result_backend(monkeypatch)
    result = app.send_task("hangar.close_run", kwargs={"job_id": 0}, queue="hangar.test-sends")

    assert calls == []
    assert result.ignored


def test_a_task_whose_result_is_read_is_still_followed(monkeypatch):
    calls = calls_to_the_result_backend(monkeypatch)
    result = ping.apply_async(args=[0.0], queue="hangar.test-sends")  # bench/start_latency.py reads its result

    assert calls == [result.id]
    sent = app.send_task("hangar.ping", args=[0.0], queue="hangar.test-sends", ignore_result=False)
    assert calls == [result.id, sent.id]
