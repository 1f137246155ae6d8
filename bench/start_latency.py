"""How fast does a job start on an idle node?

Starts a whole Hangar (`manage.py up`) in a temporary data directory, then, one
at a time, submits jobs that print one line and exit, and times submit -> first
line stored in the database (committed: on PostgreSQL the bench hears it from a
trigger of its own on the stack's log table, on SQLite it reads the table every
2 ms; see `first_line_stored`). In the same run it times a bare Celery task round
trip through the same broker to the same agent, the floor any dispatch pays.

    python bench/start_latency.py [--quick] [--jobs N] [--sandbox both|on|off]

Embedded default unless DATABASE_URL / CELERY_BROKER_URL / REDIS_URL are set.
Last line: mode=... p50_ms=... p95_ms=... celery_p50_ms=... ratio=...

With --sandbox both (as root, with bubblewrap) one stack runs two agents, one that
sandboxes its jobs (own uid, bubblewrap) and one that does not, and times their jobs
in turns. Last line: p50_on_ms=... p50_off_ms=... added_p50_ms=... (goal: at most 15).

With --against DIR a second whole stack runs the code of another checkout (DIR: another
commit's `git worktree`, on this one's virtualenv), on a database and broker prefix of its
own, and the two stacks' jobs are timed in turns, one each, in alternating order. Runs on
this machine differ by more than most changes do (the same commit's p50 read 37.6 and 49.6
ms in two runs a minute apart); in turns both sides share each minute's speed, and the
paired difference (this checkout's job minus the other's next to it) read a 3 ms sleep
added to the agent's start as +4.7 ms (p50; mean +4.0) over 60 pairs, and the same code
on both sides as -1.2 ms over 40. Last line: mode=... jobs=... p50_ms=...
against_p50_ms=... paired_diff_p50_ms=... paired_diff_mean_ms=...
"""

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

# The code timed: this checkout's, or (the other side of --against, `--turns --code DIR`) another's.
CODE = Path(sys.argv[sys.argv.index("--code") + 1] if "--code" in sys.argv else Path(__file__).parent.parent)
sys.path.insert(0, str(CODE.resolve()))

from tests.livestack import UNSANDBOXED  # noqa: E402


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def set_up_django() -> str:
    """Django set up in this process on a fresh data directory (the stack's too): its path."""
    data_dir = tempfile.mkdtemp(prefix="hangar-bench-")
    os.environ["HANGAR_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    return data_dir


def time_jobs(
    stack, count: int, submits: list[float] | None = None, stages: list[dict] | None = None, **fields
) -> list[float]:
    listener = line_listener()  # before the first submit: no line is stored unheard
    timings = []
    for _ in range(count):
        started, sent_at = time.perf_counter(), time.time()
        job = stack.submit(["echo", "hello"], name="latency", **fields)
        if submits is not None:
            submits.append((time.perf_counter() - started) * 1000)
        first_line_stored(job["id"], listener)
        timings.append((time.perf_counter() - started) * 1000)
        seen_at = time.time()
        stack.wait_for(job["id"], ("succeeded", "failed"))
        if stages is not None:
            stages.append(stages_of(job["id"], sent_at, seen_at))
    return timings


def first_line_stored(job_id: int, listener) -> None:
    """Return once the job's first stdout line is stored (committed). On PostgreSQL the database
    says so itself: a trigger this bench adds to its own stack's log table notifies at the
    commit of each stdout line (NOTIFY is sent when its transaction commits), and the bench
    waits on that, asleep. The embedded default (SQLite) has no such thing: there the table is
    read every 2 ms. On PostgreSQL that poll took CPU from the stack it timed: on this 2-core
    machine the start's steps before the line was stored read ~4 ms longer (p50 of the stages'
    sum) under a poll every 2 ms than under one every 10 ms."""
    from jobs.models import LogLine, Stream

    if listener is None:
        while not LogLine.objects.filter(job_id=job_id, stream=Stream.STDOUT).exists():
            time.sleep(0.002)
        return
    for notice in listener.notifies(timeout=60):
        if notice.payload == str(job_id):
            return
    raise TimeoutError(f"job {job_id}: no line stored in 60 s")


@functools.cache
def line_listener():
    """PostgreSQL: a connection of the bench's own listening for its trigger's notices (made
    once); None on SQLite."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    from jobs.models import LogLine, Stream

    table = connection.ops.quote_name(LogLine._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE OR REPLACE FUNCTION bench_line_stored() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_notify('bench_line_stored', NEW.job_id::text); RETURN NULL; END $$"
        )
        cursor.execute(f"DROP TRIGGER IF EXISTS bench_line_stored ON {table}")
        cursor.execute(
            f"CREATE TRIGGER bench_line_stored AFTER INSERT ON {table} FOR EACH ROW "
            f"WHEN (NEW.stream = {int(Stream.STDOUT)}) EXECUTE FUNCTION bench_line_stored()"
        )
    import psycopg

    params = connection.get_connection_params()
    where = {key: params[key] for key in ("dbname", "user", "password", "host", "port") if params.get(key)}
    listener = psycopg.connect(**where, autocommit=True)
    listener.execute("LISTEN bench_line_stored")
    return listener


def stages_of(job_id: int, sent_at: float, seen_at: float) -> dict[str, float]:
    """Where one start's time went, from the rows' own timestamps (ms): the request until the
    job's row was made, -> placed (the pass) -> taken (the agent's begin) -> running (preflight,
    the spawn) -> its line read from the pipe -> that line seen stored (by this bench's poll)."""
    from datetime import UTC, datetime

    from jobs.models import Attempt, Job, LogLine, Stream

    created = Job.objects.get(pk=job_id).created_at
    attempt = Attempt.objects.filter(job_id=job_id).order_by("number").first()
    line = LogLine.objects.filter(job_id=job_id, stream=Stream.STDOUT).order_by("seq").first()
    sent, seen = datetime.fromtimestamp(sent_at, UTC), datetime.fromtimestamp(seen_at, UTC)
    marks = [sent, created, attempt.scheduled_at, attempt.started_at, attempt.running_at, line.ts, seen]
    names = ("created", "placed", "taken", "preflight", "first_line", "stored")
    return {name: (b - a).total_seconds() * 1000 for name, a, b in zip(names, marks[:-1], marks[1:], strict=True)}


def time_celery(queue: str, count: int) -> list[float]:
    from portal.celery import ping

    timings = []
    for _ in range(count):
        started = time.perf_counter()
        ping.apply_async(args=[started], queue=queue).get(timeout=30, interval=0.002)
        timings.append((time.perf_counter() - started) * 1000)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 jobs instead of 50")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument(
        "--sandbox", choices=["both", "on", "off"], default=None, help="time jobs with the job sandbox on, off or both"
    )
    parser.add_argument("--against", metavar="DIR", help="time jobs in turns with a stack of another checkout's code")
    parser.add_argument("--turns", action="store_true", help=argparse.SUPPRESS)  # --against's other side
    parser.add_argument("--code", help=argparse.SUPPRESS)  # read before the imports (CODE)
    args = parser.parse_args()
    count = args.jobs or (10 if args.quick else 50)
    if args.sandbox is not None:
        return sandbox_bench(args.sandbox, count)
    if args.turns:
        return take_turns()
    if args.against:
        return against(Path(args.against).resolve(), count)

    data_dir = set_up_django()
    from django.conf import settings

    from tests.livestack import LiveStack

    mode = "embedded" if settings.EMBEDDED_DATABASE else "services"
    with LiveStack(data_dir=data_dir) as stack:
        queue = f"hangar.node.{stack.env['HANGAR_NODE_NAME']}"
        time_jobs(stack, 2)  # warm up: imports, connections
        time_celery(queue, 2)
        submits: list[float] = []
        stages: list[dict] = []
        jobs = time_jobs(stack, count, submits, stages)
        celery = time_celery(queue, count)

    p50, p95 = percentile(jobs, 50), percentile(jobs, 95)
    c50, c95 = percentile(celery, 50), percentile(celery, 95)
    print(f"submit -> first log line stored, {count} jobs: mean {statistics.mean(jobs):.1f} ms")
    print(f"of which the submit request itself: p50 {percentile(submits, 50):.1f} ms")
    split = ", ".join(f"{name} {percentile([s[name] for s in stages], 50):.1f}" for name in stages[0])
    print(f"from the rows' timestamps, p50 ms: {split}")
    print(f"bare Celery round trip, {count} tasks: mean {statistics.mean(celery):.1f} ms")
    print(
        f"mode={mode} jobs={count} p50_ms={p50:.1f} p95_ms={p95:.1f} "
        f"celery_p50_ms={c50:.1f} celery_p95_ms={c95:.1f} ratio={p50 / c50:.2f}"
    )


def take_turns() -> None:
    """--against's other side: a stack of CODE's; one job timed for each `go` read from stdin."""
    data_dir = set_up_django()
    from tests.livestack import LiveStack

    with LiveStack(data_dir=data_dir) as stack:
        time_jobs(stack, 2)  # warm up: imports, connections
        print("ready", flush=True)
        for _ in sys.stdin:
            stages: list[dict] = []
            (took,) = time_jobs(stack, 1, stages=stages)
            print(json.dumps({"ms": took, "stages": stages[0]}), flush=True)


def against(other: Path, count: int) -> None:
    """This checkout's stack and another's (`take_turns` in a process of its own, on a database
    and a broker prefix of its own), both up for the whole run; one job each in turn."""
    data_dir = set_up_django()
    from django.conf import settings

    from tests.livestack import LiveStack, ServicesDatabase, stack_env

    mode = "embedded" if settings.EMBEDDED_DATABASE else "services"
    # Services: a database and a Redis prefix of its own on this side's servers.
    own = ServicesDatabase(settings.DATABASE_URL, settings.REDIS_URL) if mode == "services" else nullcontext({})
    side = [sys.executable, str(Path(__file__).resolve()), "--turns", "--code", str(other)]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    timings: dict[str, list[float]] = {"this": [], "against": []}
    stages: dict[str, list[dict]] = {"this": [], "against": []}
    with own as services:
        env = {**stack_env(), **services, "HANGAR_DATA_DIR": tempfile.mkdtemp(prefix="hangar-bench-against-")}
        with subprocess.Popen(side, cwd=other, env=env, **pipes) as turns, LiveStack(data_dir=data_dir) as stack:

            def this_turn() -> tuple[float, dict]:
                split: list[dict] = []
                (took,) = time_jobs(stack, 1, stages=split)
                return took, split[0]

            def their_turn() -> tuple[float, dict]:
                turns.stdin.write("go\n")
                turns.stdin.flush()
                answer = json.loads(said(turns, other, "{"))
                return answer["ms"], answer["stages"]

            time_jobs(stack, 2)  # warm up: imports, connections
            said(turns, other, "ready")
            turn = {"this": this_turn, "against": their_turn}
            for i in range(count):
                for side_name in ("this", "against") if i % 2 == 0 else ("against", "this"):
                    took, split = turn[side_name]()
                    timings[side_name].append(took)
                    stages[side_name].append(split)
            turns.stdin.close()
    paired = [a - b for a, b in zip(timings["this"], timings["against"], strict=True)]
    for side_name, label in (("this", "this checkout"), ("against", str(other))):
        split = ", ".join(
            f"{name} {percentile([s[name] for s in stages[side_name]], 50):.1f}" for name in stages[side_name][0]
        )
        print(f"{label}: p50 {percentile(timings[side_name], 50):.1f} ms; from the rows' timestamps, p50 ms: {split}")
    print(
        f"mode={mode} jobs={count} p50_ms={percentile(timings['this'], 50):.1f} "
        f"against_p50_ms={percentile(timings['against'], 50):.1f} "
        f"paired_diff_p50_ms={statistics.median(paired):.2f} paired_diff_mean_ms={statistics.mean(paired):.2f}"
    )


def said(turns: subprocess.Popen, other: Path, start: str) -> str:
    """The other side's next line that starts with `start`; what else it prints goes to stderr."""
    while line := turns.stdout.readline():
        if line.startswith(start):
            return line
        sys.stderr.write(line)
    raise SystemExit(f"the stack of {other} stopped (exit {turns.wait()}; its output is above)")


SANDBOX_ENV = {
    "on": {"HANGAR_SANDBOX": "on", "HANGAR_JOB_UID_RANGE": "200000-299999"},
    "off": UNSANDBOXED,
}
MODEL = {"off": "H100", "on": "H200"}  # each agent's simulated GPUs: a job's gpu_type picks its agent


def sandbox_bench(which: str, count: int) -> None:
    """Jobs on a sandboxing agent and on a plain one, timed in turns in one stack."""
    data_dir = set_up_django()
    from tests.livestack import LiveStack

    modes = ["off", "on"] if which == "both" else [which]
    with LiveStack(data_dir=data_dir, env={**SANDBOX_ENV["off"], "HANGAR_SIM_GPU_MODEL": MODEL["off"]}) as stack:
        base = stack.env
        if "on" in modes:
            stack.env = {**base, **SANDBOX_ENV["on"]}
            stack.start_agent("node-sandbox", gpus=1, model=MODEL["on"])
            stack.env = base
        timings: dict[str, list[float]] = {mode: [] for mode in modes}
        for mode in modes:  # warm up: imports, connections, the page cache of bwrap
            time_jobs(stack, 2, gpu_type=MODEL[mode])
        for _ in range(count):
            for mode in modes:
                timings[mode] += time_jobs(stack, 1, gpu_type=MODEL[mode])
        isolation = {n["name"]: n["isolation"] for n in stack.api("GET", "/api/v1/nodes/").json()["results"]}
    print(f"nodes' isolation: {isolation}")
    figures = {mode: (percentile(t, 50), percentile(t, 95)) for mode, t in timings.items()}
    for mode, (p50, p95) in figures.items():
        print(f"sandbox {mode}: submit -> first log line stored, {count} jobs: p50 {p50:.1f} ms, p95 {p95:.1f} ms")
    line = " ".join(f"p50_{mode}_ms={p50:.1f} p95_{mode}_ms={p95:.1f}" for mode, (p50, p95) in figures.items())
    if len(figures) == 2:
        line += f" added_p50_ms={figures['on'][0] - figures['off'][0]:.1f}"
        wrapped, plain = time_wrap(max(count, 50))
        print(f"the start alone (Popen -> first line), {max(count, 50)} each: bare p50 {plain:.2f} ms, "
              f"in the sandbox p50 {wrapped:.2f} ms")  # fmt: skip
        line += f" wrap_added_p50_ms={wrapped - plain:.2f}"
    print(f"jobs={count} {line}")


def time_wrap(count: int) -> tuple[float, float]:
    """What the sandbox adds to a start, without the stack's noise: p50 of Popen -> first line
    of `echo`, wrapped as the Runner wraps it (its own uid, bubblewrap) and bare."""
    import subprocess

    from agent.sandbox import Sandbox, bwrap_argv, tools

    workdir = Path(tempfile.mkdtemp(prefix="hangar-bench-wrap-"))
    workdir.chmod(0o700)
    os.chown(workdir, 299999, 299999)
    found = tools()
    box = Sandbox(uid=299999, workdir=str(workdir), bwrap=found.bwrap, setpriv=found.setpriv)
    echo = [shutil.which("echo"), "hello"]
    timings: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(count):
        for wrapped in (False, True):
            started = time.perf_counter()
            proc = subprocess.Popen(bwrap_argv(box, echo) if wrapped else echo, stdout=subprocess.PIPE)
            proc.stdout.readline()
            timings[wrapped].append((time.perf_counter() - started) * 1000)
            proc.wait()
            proc.stdout.close()
    shutil.rmtree(workdir)
    return percentile(timings[True], 50), percentile(timings[False], 50)


if __name__ == "__main__":
    main()
