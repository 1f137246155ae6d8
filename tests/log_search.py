"""Log search on PostgreSQL for tests/test_logs_search.py: `seed` fills a fresh database,
`check` pages through filters with the planner's plan given 10 ms (so slow plans are
cancelled and the page is walked in windows) and compares every line with a plain read.
Prints JSON."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from fleet.models import Node  # noqa: E402
from jobs import logquery  # noqa: E402
from jobs.models import Attempt, Job, LogLine  # noqa: E402
from portal.models import Project  # noqa: E402

FILTERS = [
    {"severity": "ERROR", "rank": "3", "q": "timeout"},
    {"severity": "ERROR", "rank": "2", "q": "TIMEOUT"},
    {"rank": "1", "q": "timeout"},
    {"q": "loss=0.99[0-9]", "regex": "1"},
    {"q": "s.e.p [0-9]+ l.o", "regex": "1"},  # no trigram to look up, no line matches: a scan of all
    {"q": "step 4242 "},
    {"q": "100%_"},
    {"rank": "3", "attempt": "2"},
    {},
]
LINES = (40_000, 20_000)  # per attempt


def seed() -> None:
    call_command("migrate", interactive=False, verbosity=0)
    user = get_user_model().objects.create(username="searcher")
    project = Project.objects.create(slug="search", name="search")
    node = Node.objects.create(name="node-a", gpu_count=8)
    job = Job.objects.create(
        project=project, submitted_by=user, name="search", command=["true"], state="failed", max_runtime_seconds=60
    )
    with connection.cursor() as cursor:
        for number, lines in enumerate(LINES, start=1):
            now = timezone.now()
            attempt = Attempt.objects.create(job=job, number=number, node=node, state="failed", queued_at=now)
            # Every 50th line an error of rank 0 or 2 (i % 4): rank 3 has no errors, rank 1 no timeouts.
            cursor.execute(
                """INSERT INTO jobs_logline (job_id, attempt_id, node_id, rank, seq, rank_seq, stream, severity,
                       fault, ts, text)
                   SELECT %s, %s, %s, i %% 4, i, i, 1, CASE WHEN i %% 50 = 0 THEN 40 ELSE 20 END, false, now(),
                       CASE WHEN i %% 50 = 0 THEN 'ERROR: Timeout talking to rank ' || (i %% 4)
                            WHEN i = 777 THEN 'copied 100%%_ of shards'
                            ELSE 'step ' || i || ' loss=0.' || lpad((i %% 997)::text, 3, '0') END
                   FROM generate_series(1, %s) AS i""",
                [job.pk, attempt.pk, node.pk, lines],
            )
        cursor.execute("ANALYZE jobs_logline")
    print(json.dumps({"job": job.pk}))


def check(job_id: int) -> None:
    walks = []
    walk = logquery._walk

    def counting_walk(*args):
        walks.append(args[2])
        return walk(*args)

    logquery._walk = counting_walk
    results = {}
    for params in FILTERS:
        log_filter = logquery.LogFilter.parse(params)
        expected = list(log_filter.lines_after(job_id, (0, 0)).values_list("attempt_id", "seq"))
        settings.HANGAR_LOG_QUERY_TIMEOUT_MS = 10
        walks.clear()
        got, cursor, pages, empty = [], (0, 0), 0, 0
        while True:
            lines, cursor, more = logquery.read_page(job_id, log_filter, cursor, 500)
            got.extend((line.attempt_id, line.seq) for line in lines)
            pages, empty = pages + 1, empty + (not lines)
            if not more:
                break
        settings.HANGAR_LOG_QUERY_TIMEOUT_MS = 300
        results[json.dumps(params)] = {
            "equal": got == expected,
            "expected": len(expected),
            "got": len(got),
            "walked": len(walks),
            "pages": pages,
            "cursor_is_high_water": cursor == LogLine.high_water(job_id),
        }
    # The read's own settings do not leak into the caller's transaction.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL statement_timeout = '7s'")
        logquery.read_page(job_id, logquery.LogFilter.parse({"q": "timeout", "rank": "1"}), (0, 0), 10)
        cursor.execute("SELECT current_setting('statement_timeout'), current_setting('enable_bitmapscan')")
        restored = list(cursor.fetchone())
    # Plain text and regex searches can both use the trigram index on lower(text).
    plans = {}
    for params in ({"q": "Talking"}, {"q": "talk.ng to", "regex": "1"}):
        query = logquery.LogFilter.parse(params).lines_after(job_id, (0, 0))
        sql, args = query.query.sql_with_params()
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SET LOCAL enable_seqscan = off")
            cursor.execute("SET LOCAL enable_indexscan = off")
            cursor.execute("EXPLAIN " + sql, args)
            plans[params["q"]] = "log_text_lower_trgm" in "\n".join(row[0] for row in cursor.fetchall())
    print(json.dumps({"filters": results, "restored": restored, "trigram_plans": plans}))


if __name__ == "__main__":
    if sys.argv[1] == "seed":
        seed()
    else:
        check(int(sys.argv[2]))
