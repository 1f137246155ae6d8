"""How long does a Prometheus scrape of /metrics take at 1,000 nodes x 8 GPUs?

Seeds an embedded Hangar (a temporary SQLite database) with 1,000 nodes of 8 GPUs
and their latest telemetry, 20,000 ended attempts, 500 running ones and 200 queued
jobs, then times GET /metrics server side (Django test client: the view, its queries
and the text format, no network):

- the first scrape of a process (it reads every ended attempt once),
- later scrapes (p50, p95), which read only what changed.

    python bench/metrics.py [--quick] [--nodes N]

Then it times, apart, summing the processes' own measurements (prometheus-client's
multiprocess files) written by several processes.

Last line: scrape_ms_p50=... scrape_ms_p95=... first_scrape_ms=... nodes=... gpus=... samples=... bytes=...
multiprocess_ms=... processes=...
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GPUS = 8


def seed(nodes: int, ended: int, running: int, queued: int) -> None:
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from fleet.models import GPU, Node, NodeState
    from jobs.models import Attempt, FailureClass, Job
    from portal.models import Project

    now = timezone.now()
    models = ["H100", "B300"]
    Node.objects.bulk_create(
        Node(
            name=f"gpu-{i:04d}",
            gpu_model=models[i % 2],
            gpu_count=GPUS,
            simulated=True,
            last_heartbeat_at=now,
            state=NodeState.CORDONED if i % 50 == 7 else NodeState.READY,
        )
        for i in range(nodes)
    )
    ids = list(Node.objects.order_by("pk").values_list("pk", flat=True))
    GPU.objects.bulk_create(
        (
            GPU(
                node_id=pk,
                index=g,
                uuid=f"GPU-{pk}-{g}",
                model=models[pk % 2],
                memory_total_mb=81559,
                utilization_pct=(pk * 7 + g * 13) % 100,
                memory_used_mb=40000,
                temperature_c=40 + (pk + g) % 40,
                power_w=300,
                sm_clock_mhz=1980,
                throttle_reasons=["sw_thermal"] if (pk + g) % 61 == 0 else [],
                sampled_at=now,
            )
            for pk in ids
            for g in range(GPUS)
        ),
        batch_size=5000,
    )
    user = get_user_model().objects.create_user("bench")
    projects = [Project.objects.create(slug=f"p{i}", name=f"P{i}") for i in range(5)]
    total = ended + running + queued
    Job.objects.bulk_create(
        (
            Job(
                project=projects[i % 5],
                submitted_by=user,
                name=f"j{i}",
                command=["true"],
                max_runtime_seconds=3600,
                state="succeeded" if i < ended else ("running" if i < ended + running else "queued"),
                priority=["normal", "low", "high"][i % 3],
                queued_at=now - timedelta(seconds=600 - i % 600),
            )
            for i in range(total)
        ),
        batch_size=5000,
    )
    jobs = list(Job.objects.order_by("pk").values_list("pk", flat=True))
    Attempt.objects.bulk_create(
        (
            Attempt(
                job_id=jobs[i],
                number=1,
                node_id=ids[i % len(ids)],
                gpu_indices=[i % GPUS],
                state="succeeded" if i < ended else "running",
                failure_class="" if i % 10 else FailureClass.USER,
                queued_at=now - timedelta(seconds=120),
                scheduled_at=now - timedelta(seconds=100),
                started_at=now - timedelta(seconds=100 - (i % 50) / 1000),
                running_at=now - timedelta(seconds=90 + i % 7),
                finished_at=now if i < ended else None,
            )
            for i in range(ended + running)
        ),
        batch_size=5000,
    )


PROCESS_CODE = """
import django; django.setup()
from jobs.metrics import API_DURATION, SCHEDULER_PASS
for r in range({routes}):
    for status in ("200", "400", "404"):
        API_DURATION.labels("GET", f"/api/v1/route{{r}}/", status).observe(0.01)
SCHEDULER_PASS.observe(0.02)
"""


def multiprocess_ms(processes: int, routes: int) -> float:
    """The part of a scrape that sums the processes' own files: `processes` processes that each
    answered `routes` routes with three statuses (the web workers, scheduler and notifier of a machine)."""
    import subprocess

    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    code = PROCESS_CODE.format(routes=routes)
    root = Path(__file__).resolve().parent.parent
    children = [subprocess.Popen([sys.executable, "-c", code], cwd=root) for _ in range(processes)]
    for child in children:
        assert child.wait() == 0
    timings = []
    for _ in range(10):
        started = time.perf_counter()
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        generate_latest(registry)
        timings.append((time.perf_counter() - started) * 1000)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 nodes, 2,000 ended attempts")
    parser.add_argument("--nodes", type=int, default=None)
    args = parser.parse_args()
    nodes = args.nodes or (100 if args.quick else 1000)
    ended = 2000 if args.quick else 20000

    os.environ["HANGAR_DATA_DIR"] = tempfile.mkdtemp(prefix="hangar-bench-metrics-")
    os.environ.pop("DATABASE_URL", None)  # always a throw-away embedded database
    os.environ["HANGAR_METRICS_TOKEN"] = "bench"  # a scrape presents the token (portal/metricstoken.py)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.test import Client

    call_command("migrate", verbosity=0)
    started = time.perf_counter()
    seed(nodes, ended, min(500, nodes), 200)
    print(f"seeded {nodes} nodes x {GPUS} GPUs, {ended} ended attempts in {time.perf_counter() - started:.1f}s")

    client = Client(HTTP_AUTHORIZATION="Bearer bench")
    started = time.perf_counter()
    response = client.get("/metrics")
    first_ms = (time.perf_counter() - started) * 1000
    assert response.status_code == 200, response.status_code
    timings = []
    for _ in range(5 if args.quick else 10):
        started = time.perf_counter()
        response = client.get("/metrics")
        timings.append((time.perf_counter() - started) * 1000)
    body = response.content
    samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    timings.sort()
    p50, p95 = statistics.median(timings), timings[min(len(timings) - 1, round(0.95 * (len(timings) - 1)))]
    print(f"/metrics: first scrape {first_ms:.1f} ms, then p50 {p50:.1f} ms, p95 {p95:.1f} ms ({samples} samples)")
    procs = 2 if args.quick else 6
    mp_ms = multiprocess_ms(procs, 40)
    print(f"summing the processes' own files ({procs} processes x 40 routes x 3 statuses) adds {mp_ms:.1f} ms")
    print(
        f"scrape_ms_p50={p50:.1f} scrape_ms_p95={p95:.1f} first_scrape_ms={first_ms:.1f} nodes={nodes} "
        f"gpus={nodes * GPUS} samples={samples} bytes={len(body)} multiprocess_ms={mp_ms:.1f} processes={procs}"
    )


if __name__ == "__main__":
    main()
