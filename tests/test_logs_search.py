"""Bounded log search: a filtered page whose plan is too slow is walked in line order,
window by window, and paging through it still gives every matching line once.

On SQLite the walk is forced (the planner's read reported cancelled); on PostgreSQL
tests/log_search.py runs against a fresh database with a 10 ms statement timeout, so
the database really cancels the slow plans."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import logquery
from jobs.logquery import LogFilter, read_page
from jobs.models import LogLine, Severity
from tests.factories import api_client, make_attempt, make_job, make_node, services_database

SCRIPT = Path(__file__).with_name("log_search.py")


@pytest.fixture
def job(project, owner):
    """Attempt 1: 40 lines, attempt 2: 25; every 10th an error of rank 0 or 2; `timeout` on errors only."""
    node = make_node("node-a")
    job = make_job(project, owner)
    rows = []
    for number, count in ((1, 40), (2, 25)):
        attempt = make_attempt(job, node, "failed")
        assert attempt.number == number
        for seq in range(1, count + 1):
            error = seq % 10 == 0
            rows.append(
                LogLine(
                    job=job,
                    attempt=attempt,
                    node=node,
                    rank=seq % 4,
                    seq=seq,
                    rank_seq=seq,
                    stream=1,
                    severity=Severity.ERROR if error else Severity.INFO,
                    ts=attempt.queued_at,
                    text=f"ERROR: timeout at {seq}" if error else f"step {seq}",
                )
            )
    LogLine.objects.bulk_create(rows)
    return job


@pytest.fixture
def walking(monkeypatch, settings):
    """Every filtered read walks (as if the database cancelled the planner's plan), in
    windows of 7 lines, and a page ends after its first window (no time budget)."""
    real = logquery.bounded

    def planner_cancelled(query, in_order=False, timeout_ms=None):
        return real(query, in_order, timeout_ms) if in_order else None

    monkeypatch.setattr(logquery, "bounded", planner_cancelled)
    monkeypatch.setattr(logquery, "WALK_WINDOW", 7)
    monkeypatch.setattr(logquery, "WALK_WINDOW_MIN", 2)
    settings.HANGAR_LOG_PAGE_BUDGET_MS = 0


def page_through(job, params, limit=3):
    log_filter = LogFilter.parse(params)
    numbers = dict(job.attempts.values_list("pk", "number"))
    got, cursor, pages = [], (0, 0), []
    while True:
        lines, cursor, more = read_page(job.pk, log_filter, cursor, limit)
        got.extend((numbers[line.attempt_id], line.seq) for line in lines)
        pages.append(len(lines))
        if not more:
            return got, cursor, pages


def plain(job, params):
    lines = LogFilter.parse(params).lines_after(job.pk, (0, 0)).select_related("attempt")
    return [(line.attempt.number, line.seq) for line in lines]


@pytest.mark.parametrize(
    "params",
    [{}, {"severity": "ERROR"}, {"rank": "2", "q": "TIMEOUT"}, {"rank": "3", "q": "timeout"}, {"attempt": "2"}],
)
def test_a_walked_filter_pages_through_every_matching_line_once(walking, job, params):
    got, cursor, pages = page_through(job, params)

    assert got == plain(job, params)
    assert cursor == LogLine.high_water(job.pk)
    if params:
        assert 0 in pages[:-1]  # windows without a match answer empty pages that say more is coming


def test_a_walk_halves_a_window_the_database_cancels(walking, job, monkeypatch):
    windows = []
    real = logquery.bounded

    def cancel_windows_over_3_lines(query, in_order=False, timeout_ms=None):
        if not in_order:
            return None
        low, high = map(int, re.search(r'"seq" > (\d+) AND "jobs_logline"."seq" <= (\d+)', str(query.query)).groups())
        windows.append(high - low)
        return real(query, in_order, timeout_ms) if high - low <= 3 else None

    monkeypatch.setattr(logquery, "bounded", cancel_windows_over_3_lines)
    got, _, _ = page_through(job, {"q": "timeout"})

    assert got == plain(job, {"q": "timeout"})
    cancelled = [i for i, size in enumerate(windows[:-1]) if size > 3]
    assert windows[0] == 7 and cancelled
    assert all(windows[i + 1] < windows[i] for i in cancelled)  # retried at once, smaller


def test_the_walk_stops_at_the_high_water_mark(walking, job):
    """Lines after the mark may still be on their way: the walk's cursor never passes it."""
    high = LogLine.high_water(job.pk)
    LogLine.objects.filter(attempt__number=2, seq__gt=20).delete()  # not stored yet
    lines, cursor, more = read_page(job.pk, LogFilter.parse({"q": "nothing"}), (0, 0), 100)
    assert (lines, more) == ([], True)
    while more:
        lines, cursor, more = read_page(job.pk, LogFilter.parse({"q": "nothing"}), cursor, 100)
    assert cursor == LogLine.high_water(job.pk) < high


def test_the_api_says_more_on_an_empty_walked_page_and_the_next_call_goes_on(walking, owner, job):
    client, params, seen = api_client(owner), {"rank": "3", "q": "timeout", "limit": 2}, 0
    cursor = {"attempt": 0, "seq": 0}
    empty_with_more = 0
    for _ in range(50):
        body = client.get(
            f"/api/v1/jobs/{job.pk}/logs/", {**params, "after_attempt": cursor["attempt"], "after_seq": cursor["seq"]}
        ).json()
        seen += len(body["lines"])
        empty_with_more += not body["lines"] and body["more"]
        cursor = body["cursor"]
        if not body["more"]:
            break
    assert (seen, body["more"], body["final"]) == (0, False, True)
    assert empty_with_more > 0


def test_the_download_of_a_walked_filter_has_every_matching_line(walking, owner, job):
    response = api_client(owner).get(f"/api/v1/jobs/{job.pk}/logs/download/", {"as": "jsonl", "severity": "ERROR"})
    lines = [json.loads(row) for row in b"".join(response.streaming_content).decode().splitlines()]
    assert [(line["attempt_number"], line["seq"]) for line in lines] == plain(job, {"severity": "ERROR"})


def test_search_on_postgresql_cancels_slow_plans_and_misses_nothing(tmp_path):
    with services_database() as env:
        env = {**os.environ, **env, "HANGAR_DATA_DIR": str(tmp_path)}
        seeded = run(env, "seed")
        result = run(env, "check", str(seeded["job"]))

    for params, outcome in result["filters"].items():
        assert outcome["equal"] and outcome["cursor_is_high_water"], (params, outcome)
    walked = {params: outcome["walked"] for params, outcome in result["filters"].items()}
    assert walked['{"q": "s.e.p [0-9]+ l.o", "regex": "1"}'] > 0, walked  # a regex over 60,000 lines in 10 ms
    assert walked["{}"] == 0  # an unfiltered page is one index range, never bounded
    assert result["restored"] == ["7s", "on"]
    assert result["trigram_plans"] == {"Talking": True, "talk.ng to": True}


def run(env, *args) -> dict:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "pattern, like",
    [
        ("loss=0.99[0-9]", "%loss=0_99%"),  # `.` is any character: LIKE's `_`
        ("(?i)Timeout talking", "%timeout talking%"),
        ("NCCL (WARN|INFO)", "%nccl %"),  # not into a group
        ("ab*cdef", "%cdef%"),  # not under a repeat
        ("100%_x", "%100\\%\\_x%"),  # LIKE's own wildcards escaped
        ("a|bcdef", ""),  # alternatives: no stretch is required
        ("a.b", ""),  # under three plain characters narrows nothing
        ("[Éé]tape \\d+", "%tape %"),  # only plain ASCII characters
        ("étÉ \\d+", ""),
    ],
)
def test_a_regex_is_prefiltered_by_a_like_every_match_passes(pattern, like):
    assert logquery.like_prefilter(pattern) == like


@pytest.mark.parametrize("pattern", ["loss=0.99[0-9]", "ERROR: t.meout", "(?i)STEP 1\\d", "x{2}yzw"])
def test_every_line_a_regex_matches_passes_its_prefilter(pattern):
    like = logquery.like_prefilter(pattern)
    assert like
    lines = ["step 17 loss=0.991", "ERROR: timeout at 3", "step 12", "xxyzw", "loss=0.5", "nothing"]
    for line in lines:
        if re.search(pattern, line, re.IGNORECASE):
            assert re.match(like_to_regex(like), line.lower(), re.DOTALL), (pattern, like, line)


def like_to_regex(like: str) -> str:
    out, chars = [], iter(like)
    for char in chars:
        if char == "\\":
            out.append(re.escape(next(chars)))
        else:
            out.append({"%": ".*", "_": "."}.get(char, re.escape(char)))
    return "".join(out)
