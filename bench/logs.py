"""How fast do log lines get in, get out, and get found?

Starts a whole Hangar (`manage.py up`) in a temporary data directory, then:

1. ingest: a job prints N lines as fast as it can; lines/s from the first line
   stored to the last (the agent's reader, parser, batcher and bulk insert);
2. raw insert: the same table, rows inserted straight from this process with the
   agent's own bulk path (COPY on PostgreSQL, multi-row INSERT on SQLite) in
   batches of 5,000: the ceiling, and the ratio ingest/raw;
3. delivery: a job prints timestamped lines; p50/p99 from print to arrival at a
   websocket client;
4. query: the first page of a filter over the raw rows: severity >= ERROR, rank and
   text (the headline), and shapes the planner misjudges (QUERIES; the worst of them).

    python bench/logs.py [--quick] [--services] [--lines N] [--rows N]

Embedded default unless DATABASE_URL / CELERY_BROKER_URL / REDIS_URL are set;
--services makes a fresh database on the test PostgreSQL and a key prefix of
its own on the test Redis (tests.livestack.ServicesDatabase), dropped after.
The default query table has 1,000,000 rows, not 10 million (--rows 10000000 for
that, slow on small machines). Last line: mode=... ingest_lines_per_s=...
raw_insert_lines_per_s=... ratio=... agent_cpu_us_per_line=... db_cpu_us_per_line=...
p50_ms=... p99_ms=... query_rows=... query_ms=... query_worst_ms=...
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FLOOD = """
import sys
n, out = {lines}, sys.stdout.buffer
for start in range(0, n, 5000):
    chunk = range(start, min(n, start + 5000))
    out.write("".join(f"step {{i}} loss=0.{{i % 997:03d}} tokens/s=51234 lr=3e-4\\n" for i in chunk).encode())
    out.flush()
"""

TICKS = """
import time
time.sleep(2)
for i in range({count}):
    print(f"tick {{time.time():.6f}}", flush=True)
    time.sleep(0.02)
"""


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used (Linux /proc), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def agent_pid(stack) -> int:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            args = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == stack.proc.pid and b"agent" in args:
            return int(stat.parent.name)
    raise RuntimeError("the stack's agent process was not found")


def database_cpu() -> dict[int, float]:
    """CPU used so far by each PostgreSQL backend of this database (the server runs on this machine)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return {pid: cpu_seconds(pid) for (pid,) in cursor.fetchall()}


class CpuMeter:
    """CPU of the agent process and of the database's backends over an interval: unlike
    lines/s, it does not depend on what else the machine is running."""

    def __init__(self, stack):
        self.agent = agent_pid(stack)
        self.agent_start, self.db_start = cpu_seconds(self.agent), database_cpu()

    def stop(self) -> tuple[float, float]:
        agent = cpu_seconds(self.agent) - self.agent_start
        db = sum(cpu - self.db_start.get(pid, 0.0) for pid, cpu in database_cpu().items())
        return agent, db


def measure_ingest(stack, lines: int) -> tuple[float, float, float]:
    """Lines/s, and the agent's and the database's CPU microseconds per line."""
    from jobs.models import LogLine, Stream

    job = stack.submit([sys.executable, "-c", textwrap.dedent(FLOOD.format(lines=lines))], name="bench-ingest")
    stdout = LogLine.objects.filter(job_id=job["id"], stream=Stream.STDOUT)
    while not stdout.exists():
        time.sleep(0.01)
    meter = CpuMeter(stack)  # from the first line stored, as the rate: not the job's start
    started = time.perf_counter()
    first = stdout.order_by("seq").values_list("seq", flat=True).first()
    deadline = started + 600
    while LogLine.high_water(job["id"])[1] < first + lines - 1 and time.perf_counter() < deadline:
        time.sleep(0.02)
    elapsed = time.perf_counter() - started
    agent_cpu, db_cpu = meter.stop()
    stack.wait_for(job["id"], ("succeeded", "failed"), timeout=120)
    return lines / elapsed, agent_cpu / lines * 1e6, db_cpu / lines * 1e6


def bench_attempt():
    """A finished job and attempt of the stack's own project to hang raw rows on."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from fleet.models import Node
    from jobs.models import Attempt, Job
    from portal.models import Project

    job = Job.objects.create(
        project=Project.objects.get(slug="default"),
        submitted_by=get_user_model().objects.get(username="admin"),
        name="bench-raw",
        command=["true"],
        max_runtime_seconds=60,
        state="succeeded",
    )
    return Attempt.objects.create(
        job=job, number=1, node=Node.objects.get(name="node-a"), state="succeeded", queued_at=timezone.now()
    )


def measure_raw(rows: int) -> tuple[float, object]:
    from django.db import transaction
    from django.utils import timezone

    from agent.output import MAX_BATCH
    from jobs.logstore import NewLine, insert_rows
    from jobs.models import Severity, Stream

    attempt = bench_attempt()
    now = timezone.now()
    elapsed = 0.0
    for start in range(0, rows, MAX_BATCH):
        batch = []
        for i in range(start, min(rows, start + MAX_BATCH)):
            error = i % 100 == 0
            batch.append(
                NewLine(
                    job_id=attempt.job_id,
                    attempt_id=attempt.pk,
                    node_id=attempt.node_id,
                    rank=i % 8,
                    rank_seq=i // 8 + 1,
                    seq=i + 1,
                    stream=Stream.STDERR if error else Stream.STDOUT,
                    severity=Severity.ERROR if error else Severity.INFO,
                    fault=False,
                    ts=now,
                    text=f"ERROR: timeout talking to rank {i % 8}" if error else f"step {i} loss=0.{i % 997:03d}",
                )
            )
        began = time.perf_counter()
        with transaction.atomic():
            insert_rows(batch)
        elapsed += time.perf_counter() - began
    return rows / elapsed, attempt


def analyze() -> None:
    """Fresh statistics, as autovacuum would gather soon after a bulk load (PostgreSQL only)."""
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE jobs_logline")


# Filtered pages over the raw rows. Every 100th row is an error of rank 0 or 4 saying
# "timeout"; the first is the headline (severity >= ERROR, rank, text: nothing matches),
# the others are shapes whose filters the planner's estimates get wrong.
QUERIES = {
    "errors_rank_text": {"severity": "ERROR", "rank": "3", "q": "timeout"},
    "errors_rank_text_dense": {"severity": "ERROR", "rank": "4", "q": "timeout"},
    "rank_text_none": {"rank": "3", "q": "timeout"},
    "text": {"q": "timeout"},
    "regex": {"q": "loss=0.99[0-9]", "regex": "1"},
    "node_rank": {"node": "node-a", "rank": "5"},
}


def measure_queries(attempt, repeats: int = 3) -> dict[str, tuple[float, int, bool]]:
    """Per shape: median ms of the first page (1,000 lines), its lines, and whether more pages follow."""
    from jobs.logquery import LogFilter, read_page, wire_lines

    results = {}
    for name, params in QUERIES.items():
        log_filter = LogFilter.parse(params)
        timings = []
        for _ in range(repeats):
            began = time.perf_counter()
            lines, _, more = read_page(attempt.job_id, log_filter, (0, 0), 1000)
            wire_lines(lines, log_filter.pattern())
            timings.append((time.perf_counter() - began) * 1000)
        results[name] = (statistics.median(timings), len(lines), more)
    return results


def measure_delivery(stack, count: int) -> list[float]:
    from websockets.sync.client import connect

    job = stack.submit([sys.executable, "-c", textwrap.dedent(TICKS.format(count=count))], name="bench-latency")
    url = f"{stack.ws_url}/ws/jobs/{job['id']}/logs/?q=tick"
    latencies = []
    with connect(url, additional_headers=stack.headers(), open_timeout=10) as ws:
        while True:
            message = json.loads(ws.recv(timeout=60))
            arrived = time.time()
            if message["type"] == "lines":
                for line in message["lines"]:
                    latencies.append((arrived - float(line["text"].split()[1])) * 1000)
            elif message["type"] == "state" and message["final"]:
                return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 lines, 50,000 rows, 50 ticks")
    parser.add_argument("--lines", type=int, default=None, help="lines the ingest job prints (default 200,000)")
    parser.add_argument("--rows", type=int, default=None, help="rows of the raw insert and query (default 1,000,000)")
    parser.add_argument("--services", action="store_true", help="a fresh database on the test PostgreSQL and Redis")
    args = parser.parse_args()
    if args.services:
        from tests.livestack import ServicesDatabase

        with ServicesDatabase() as env:
            os.environ.update(env)
            run(args)
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    lines = args.lines or (20_000 if args.quick else 200_000)
    rows = args.rows or (50_000 if args.quick else 1_000_000)
    ticks = 50 if args.quick else 250

    data_dir = tempfile.mkdtemp(prefix="hangar-bench-")
    os.environ["HANGAR_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.conf import settings

    from tests.livestack import UNSANDBOXED, LiveStack

    mode = "embedded" if settings.EMBEDDED_DATABASE else "services"
    with LiveStack(data_dir=data_dir, env=UNSANDBOXED) as stack:  # its jobs run this interpreter
        ingest, agent_us, db_us = measure_ingest(stack, lines)
        print(f"ingest: {lines} lines printed as fast as possible, stored at {ingest:,.0f} lines/s")
        print(f"CPU per line: agent {agent_us:.1f} us, PostgreSQL backends {db_us:.1f} us (embedded: all in the agent)")
        latencies = measure_delivery(stack, ticks)
        p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
        print(f"delivery, print -> websocket client, {len(latencies)} lines: p50 {p50:.1f} ms, p99 {p99:.1f} ms")
        raw, attempt = measure_raw(rows)
        analyze()
        print(f"raw bulk insert into the same table, {rows} rows: {raw:,.0f} rows/s")
        queries = measure_queries(attempt)
        for name, (ms, found, more) in queries.items():
            print(f"first page of {json.dumps(QUERIES[name])}, {rows} rows: {ms:.1f} ms, {found} lines, more={more}")
        query, worst = queries["errors_rank_text"][0], max(ms for ms, _, _ in queries.values())
    print(
        f"mode={mode} lines={lines} ingest_lines_per_s={ingest:.0f} raw_insert_lines_per_s={raw:.0f} "
        f"ratio={ingest / raw:.2f} agent_cpu_us_per_line={agent_us:.1f} db_cpu_us_per_line={db_us:.1f} "
        f"p50_ms={p50:.1f} p99_ms={p99:.1f} query_rows={rows} query_ms={query:.1f} query_worst_ms={worst:.1f}"
    )


if __name__ == "__main__":
    main()
