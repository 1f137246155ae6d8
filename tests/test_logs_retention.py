"""Log retention deletes only expired lines, in bounded batches, when due."""

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs import logretention
from jobs.models import LogLine, Stream
from tests.factories import make_attempt, make_job


@pytest.fixture
def aged_lines(project, owner, node):
    attempt = make_attempt(make_job(project, owner), node, "succeeded")
    now = timezone.now()
    ages = [90, 61, 60.01, 59.9, 10, 0]
    LogLine.objects.bulk_create(
        LogLine(
            job_id=attempt.job_id,
            attempt=attempt,
            node=node,
            seq=seq,
            rank_seq=seq,
            stream=Stream.STDOUT,
            ts=now - timedelta(days=days),
            text=f"{days} days old",
        )
        for seq, days in enumerate(ages, start=1)
    )
    return attempt


def remaining() -> list[str]:
    return list(LogLine.objects.order_by("seq").values_list("text", flat=True))


def test_it_deletes_only_lines_older_than_the_retention(aged_lines):
    deleted = LogLine.delete_expired(days=60)

    assert deleted == 3
    assert remaining() == ["59.9 days old", "10 days old", "0 days old"]


def test_it_deletes_in_bounded_batches(aged_lines):
    assert LogLine.delete_expired(days=60, batch=2, max_batches=1) == 2
    assert remaining() == ["60.01 days old", "59.9 days old", "10 days old", "0 days old"]


def test_the_periodic_pass_runs_when_due_and_follows_the_setting(aged_lines, settings, monkeypatch):
    settings.HANGAR_LOG_RETENTION_DAYS = 30
    settings.HANGAR_LOG_RETENTION_INTERVAL_SECONDS = 3600
    monkeypatch.setattr(logretention, "_next_run", 0.0)

    assert logretention.enforce_retention_if_due() == 4
    LogLine.objects.filter(text="10 days old").update(ts=timezone.now() - timedelta(days=45))
    assert logretention.enforce_retention_if_due() == 0  # not due for an hour
    assert remaining() == ["10 days old", "0 days old"]


def test_a_backlog_makes_the_next_pass_due_at_once(aged_lines, monkeypatch):
    monkeypatch.setattr(logretention, "_next_run", 0.0)
    monkeypatch.setattr(logretention, "BATCH", 1)
    monkeypatch.setattr(logretention, "BATCHES_PER_PASS", 2)

    assert logretention.enforce_retention_if_due() == 2
    assert logretention.enforce_retention_if_due() == 1
    assert logretention.enforce_retention_if_due() == 0
