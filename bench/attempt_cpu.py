"""What does one short job cost in CPU, on each side, with no stack around it?

The figure that bounds short-job throughput on a small machine: every process of a stack
shares its cores, so jobs/s can be no more than cores / CPU seconds per job. This bench
runs the pieces of one job in one process, in turn, and counts the CPU each takes:

- submit: `submit_job` (what the web server does for POST /api/v1/jobs/, less HTTP);
- pass: a scheduling pass that places 8 jobs, per job placed;
- attempt: the agent's side of an `echo` attempt, `agent.runner.run_attempt` from begin
  through preflight, spawn, output and the recorded outcome (with its MLflow run and the
  receivers of its end), counted over all the threads it uses;
- close: what the notifier does a moment after it (jobs/settling.py `settle`: the attempt's
  cost, the job's state, cost and final status on its MLflow run).

On PostgreSQL each step's figure also gives the database's own CPU for it: the server
processes of the bench's database (read from /proc: the server runs on this machine),
which parse, plan and run every statement the step sent and flush its commits.

On an embedded default (SQLite in a temporary directory, the local MLflow store), or on
PostgreSQL when DATABASE_URL is set (a fresh database, dropped after). Simulated GPUs,
jobs unsandboxed (the sandbox's own cost is bench/start_latency.py --sandbox both's).

    python bench/attempt_cpu.py [--quick] [--jobs N] [--profile] [--sql]

--profile prints where the attempt's CPU goes (cProfile, every thread; it slows what it
measures about twofold); --sql lists the statements of one attempt, with the thread that
sent each. Last line: mode=... attempts=... attempt_cpu_ms=... submit_cpu_ms=... (and
attempt_db_cpu_ms=... job_db_cpu_ms=... on PostgreSQL)
"""

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.livestack import UNSANDBOXED  # noqa: E402

ROUND = 8  # jobs placed per pass: one simulated 8-GPU node
STEPS = ("submit", "pass", "attempt", "close")
PROFILES: list[cProfile.Profile] = []


def profile_every_thread() -> None:
    """cProfile each thread started from now on (per-thread CPU time), to merge at the end."""
    start = threading.Thread.start

    def profiled_start(thread: threading.Thread) -> None:
        inner = thread.run

        def run() -> None:
            profile = cProfile.Profile(time.thread_time)
            PROFILES.append(profile)
            profile.runcall(inner)

        thread.run = run
        start(thread)

    threading.Thread.start = profiled_start


class QueryCounter:
    """Counts the SQL statements every thread sends (CPU noise aside, the work is in them)."""

    def __init__(self):
        from django.db.backends import utils

        self.count = 0
        self.lock = threading.Lock()
        self.recorded: list[str] | None = None  # the statements' text, when asked to keep it
        for name in ("execute", "executemany"):
            original = getattr(utils.CursorWrapper, name)
            setattr(utils.CursorWrapper, name, self.counting(original))

    def counting(self, original):
        def call(cursor, *args, **kwargs):
            with self.lock:
                self.count += 1
                if self.recorded is not None:
                    self.recorded.append(f"[{threading.current_thread().name}] {str(args[0])[:160]}")
            return original(cursor, *args, **kwargs)

        return call


class DatabaseCPU:
    """CPU seconds spent so far by the PostgreSQL server processes of one database on this
    machine (a backend's command line names its database), those that ended included."""

    def __init__(self, name: str):
        self.marker = f" {name} "
        self.seen: dict[int, float] = {}

    def __call__(self) -> float:
        from throughput import cpu_seconds, processes

        for pid, (_, cmdline) in processes().items():
            if cmdline.startswith("postgres:") and self.marker in cmdline:
                self.seen[pid] = cpu_seconds(pid)
        return sum(self.seen.values())


def setup():
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from agent import running
    from agent.node import Agent
    from fleet.gpus import detect_provider
    from fleet.models import Node
    from tests.factories import make_project, make_user

    owner = make_user("bench")
    make_project("bench", admin=owner)
    agent = Agent("bench-node", detect_provider("bench-node", simulate=True, count=ROUND), 5.0)
    node = agent.register()
    Node.objects.filter(pk=node.pk).update(state="ready")
    running.CURRENT = agent  # the preflight reads this agent's (simulated) GPUs, as on a node
    return owner, node


def one_round(
    owner, node, queries: QueryCounter | None = None, database: DatabaseCPU | None = None
) -> dict[str, list[float]]:
    """Submit ROUND echo jobs, place them in one pass, run each attempt: each step's CPU
    seconds, SQL statements and the database's CPU seconds, and the attempts placed."""
    from django.utils import timezone

    from agent import runner
    from fleet.models import Node
    from jobs.api.serializers import JobSubmitSerializer
    from jobs.scheduler import schedule_pass
    from jobs.settling import settle
    from jobs.submission import submit_job

    spec = {"project": "bench", "name": "echo", "command": ["echo", "hello"], "gpus_per_node": 1}

    def mark() -> tuple[float, float, int, float]:
        """This process's CPU before and after reading the database's (no step's), statements, the database's CPU."""
        before = time.process_time()
        spent = database() if database else 0.0
        return (before, time.process_time(), queries.count if queries else 0, spent)

    marks = [mark()]

    for _ in range(ROUND):
        checked = JobSubmitSerializer(data=dict(spec))
        checked.is_valid(raise_exception=True)
        submit_job(owner, checked.validated_data)
    marks.append(mark())
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=timezone.now())
    placed = schedule_pass()
    marks.append(mark())
    for attempt in placed:
        runner.run_attempt(attempt.pk, 0)
    marks.append(mark())
    for attempt in placed:  # what the notifier does for each, a moment after its end
        settle(attempt.pk)
    marks.append(mark())
    steps = {}
    for name, (before, after) in zip(STEPS, zip(marks, marks[1:], strict=False), strict=True):
        steps[name] = [after[0] - before[1], after[2] - before[2], after[3] - before[3]]
    steps["placed"] = [len(placed), 0, 0.0]
    return steps


def print_one_attempt(owner, node, queries: QueryCounter) -> None:
    """The statements of a round's last attempt, in order, with the thread that sent each."""
    from agent import runner

    runs = []
    original = runner.run_attempt

    def recording(attempt_id, rank):
        queries.recorded = []
        original(attempt_id, rank)
        runs.append(queries.recorded)
        queries.recorded = None

    runner.run_attempt = recording
    try:
        one_round(owner, node, queries)
    finally:
        runner.run_attempt = original
    print(f"one echo attempt, {len(runs[-1])} statements:")
    for statement in runs[-1]:
        print("  " + statement)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 attempts")
    parser.add_argument("--jobs", type=int, help="attempts to time (rounded up to a multiple of 8)")
    parser.add_argument("--profile", action="store_true", help="print where the attempts' CPU goes")
    parser.add_argument("--sql", action="store_true", help="print the SQL statements of one attempt")
    args = parser.parse_args()
    jobs = args.jobs or (40 if args.quick else 160)

    os.environ.update(UNSANDBOXED)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ["HANGAR_DATA_DIR"] = tempfile.mkdtemp(prefix="hangar-bench-attempt-")
    admin_url, db_name = os.environ.get("DATABASE_URL", ""), None
    if admin_url:
        from scheduler import fresh_postgres

        os.environ["DATABASE_URL"], db_name = fresh_postgres(admin_url)
    try:
        run(jobs, args.profile, args.sql, DatabaseCPU(db_name) if db_name else None)
    finally:
        if db_name:
            from django.db import connections
            from scheduler import drop_postgres

            connections.close_all()
            drop_postgres(admin_url, db_name)


def run(jobs: int, profile: bool, sql: bool = False, database: DatabaseCPU | None = None) -> None:
    from django.conf import settings

    owner, node = setup()
    one_round(owner, node)  # warm up: imports, the MLflow store and experiment, connections
    one_round(owner, node)
    queries = QueryCounter()
    if sql:
        print_one_attempt(owner, node, queries)
    main_thread = cProfile.Profile(time.thread_time)
    if profile:
        profile_every_thread()
        main_thread.enable()
    totals = {name: [0.0, 0, 0.0] for name in (*STEPS, "placed")}
    wall = time.perf_counter()
    while totals["placed"][0] < jobs:
        for name, (cpu, statements, db_cpu) in one_round(owner, node, queries, database).items():
            totals[name][0] += cpu
            totals[name][1] += statements
            totals[name][2] += db_cpu
    wall = time.perf_counter() - wall
    main_thread.disable()
    count = int(totals["placed"][0])
    cpu = {name: totals[name][0] / count * 1000 for name in STEPS}
    sql = {name: totals[name][1] / count for name in STEPS}
    db_cpu = {name: totals[name][2] / count * 1000 for name in STEPS}
    if profile:
        stats = pstats.Stats(main_thread)
        for other in PROFILES:
            stats.add(other)
        stats.sort_stats("cumulative").print_stats(r"/(agent|jobs|fleet|portal)/|mlflow/tracking/client", 40)
        stats.sort_stats("tottime").print_stats(25)  # the functions that spend it themselves
    mode = "embedded" if settings.EMBEDDED_DATABASE else "services"
    print(f"{count} echo attempts, {wall / count * 1000:.1f} ms each of wall time, everything included")
    for name in cpu:
        in_database = f", {db_cpu[name]:.1f} ms of the database's" if database else ""
        print(f"  {name}: {cpu[name]:.1f} ms of CPU, {sql[name]:.1f} SQL statements per job{in_database}")
    in_database = (
        f" attempt_db_cpu_ms={db_cpu['attempt']:.1f} job_db_cpu_ms={sum(db_cpu.values()):.1f}" if database else ""
    )
    print(
        f"mode={mode} attempts={count} attempt_cpu_ms={cpu['attempt']:.1f} attempt_sql={sql['attempt']:.1f} "
        f"submit_cpu_ms={cpu['submit']:.1f} submit_sql={sql['submit']:.1f} pass_cpu_ms={cpu['pass']:.1f} "
        f"close_cpu_ms={cpu['close']:.1f} "
        f"job_cpu_ms={sum(cpu.values()):.1f} job_sql={sum(sql.values()):.1f}{in_database}"
    )


if __name__ == "__main__":
    main()
