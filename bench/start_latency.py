"""How fast does a job start on an idle node?

Starts a whole Hangar (`manage.py up`) in a temporary data directory, then, one
at a time, submits jobs that print one line and exit, and times submit -> first
line stored in the database. In the same run it times a bare Celery task round
trip through the same broker to the same agent, the floor any dispatch pays.

    python bench/start_latency.py [--quick] [--jobs N]

Embedded default unless DATABASE_URL / CELERY_BROKER_URL / REDIS_URL are set.
Last line: mode=... p50_ms=... p95_ms=... celery_p50_ms=... ratio=...
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def time_jobs(stack, count: int, submits: list[float] | None = None) -> list[float]:
    from jobs.models import LogLine, Stream

    timings = []
    for _ in range(count):
        started = time.perf_counter()
        job = stack.submit(["echo", "hello"], name="latency")
        if submits is not None:
            submits.append((time.perf_counter() - started) * 1000)
        while not LogLine.objects.filter(job_id=job["id"], stream=Stream.STDOUT).exists():
            time.sleep(0.002)
        timings.append((time.perf_counter() - started) * 1000)
        stack.wait_for(job["id"], ("succeeded", "failed"))
    return timings


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
    args = parser.parse_args()
    count = args.jobs or (10 if args.quick else 50)

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
        jobs = time_jobs(stack, count, submits)
        celery = time_celery(queue, count)

    p50, p95 = percentile(jobs, 50), percentile(jobs, 95)
    c50, c95 = percentile(celery, 50), percentile(celery, 95)
    print(f"submit -> first log line stored, {count} jobs: mean {statistics.mean(jobs):.1f} ms")
    print(f"of which the submit request itself: p50 {percentile(submits, 50):.1f} ms")
    print(f"bare Celery round trip, {count} tasks: mean {statistics.mean(celery):.1f} ms")
    print(
        f"mode={mode} jobs={count} p50_ms={p50:.1f} p95_ms={p95:.1f} "
        f"celery_p50_ms={c50:.1f} celery_p95_ms={c95:.1f} ratio={p50 / c50:.2f}"
    )


if __name__ == "__main__":
    main()
