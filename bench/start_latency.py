"""How fast does a job start on an idle node?

Starts a whole Hangar (`manage.py up`) in a temporary data directory, then, one
at a time, submits jobs that print one line and exit, and times submit -> first
line stored in the database. In the same run it times a bare Celery task round
trip through the same broker to the same agent, the floor any dispatch pays.

    python bench/start_latency.py [--quick] [--jobs N] [--sandbox both|on|off]

Embedded default unless DATABASE_URL / CELERY_BROKER_URL / REDIS_URL are set.
Last line: mode=... p50_ms=... p95_ms=... celery_p50_ms=... ratio=...

With --sandbox both (as root, with bubblewrap) one stack runs two agents, one that
sandboxes its jobs (own uid, bubblewrap) and one that does not, and times their jobs
in turns. Last line: p50_on_ms=... p50_off_ms=... added_p50_ms=... (goal: at most 15).
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.livestack import UNSANDBOXED  # noqa: E402


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def time_jobs(
    stack, count: int, submits: list[float] | None = None, stages: list[dict] | None = None, **fields
) -> list[float]:
    from jobs.models import LogLine, Stream

    timings = []
    for _ in range(count):
        started, sent_at = time.perf_counter(), time.time()
        job = stack.submit(["echo", "hello"], name="latency", **fields)
        if submits is not None:
            submits.append((time.perf_counter() - started) * 1000)
        while not LogLine.objects.filter(job_id=job["id"], stream=Stream.STDOUT).exists():
            time.sleep(0.002)
        timings.append((time.perf_counter() - started) * 1000)
        seen_at = time.time()
        stack.wait_for(job["id"], ("succeeded", "failed"))
        if stages is not None:
            stages.append(stages_of(job["id"], sent_at, seen_at))
    return timings


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
    args = parser.parse_args()
    count = args.jobs or (10 if args.quick else 50)
    if args.sandbox is not None:
        return sandbox_bench(args.sandbox, count)

    data_dir = tempfile.mkdtemp(prefix="hangar-bench-")
    os.environ["HANGAR_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
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


SANDBOX_ENV = {
    "on": {"HANGAR_SANDBOX": "on", "HANGAR_JOB_UID_RANGE": "200000-299999"},
    "off": UNSANDBOXED,
}
MODEL = {"off": "H100", "on": "H200"}  # each agent's simulated GPUs: a job's gpu_type picks its agent


def sandbox_bench(which: str, count: int) -> None:
    """Jobs on a sandboxing agent and on a plain one, timed in turns in one stack."""
    data_dir = tempfile.mkdtemp(prefix="hangar-bench-")
    os.environ["HANGAR_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
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
    box = Sandbox(uid=299999, workdir=str(workdir), bwrap=found.bwrap, setpriv=found.setpriv, env=found.env)
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
