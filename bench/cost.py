"""How fast are the cost pages on a large history?

Seeds jobs and attempts over 90 days (with their per-job costs and the daily
roll-up, as finishing attempts leave them) into a throw-away database, then
times, in-process (server time, no network): the cost overview page, a
filtered and sorted page of the per-job table, and the CSV export's rows/s.

    python bench/cost.py [--quick] [--attempts N]

Embedded default (a fresh SQLite file) unless DATABASE_URL is set: then a fresh
database is created on that PostgreSQL server and dropped afterwards.
Default size: 1,000,000 attempts on PostgreSQL, 300,000 on SQLite (seeding a
million rows into SQLite takes minutes on a small machine; --attempts 1000000
does it anyway); --quick: 20,000.
Last line: db=... attempts=... jobs=... overview_ms=... table_page_ms=... csv_rows_per_s=...
"""

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GPU_TYPES = {"H100": 2.5, "B300": 6.0, "A100": 1.2, "L40S": 0.8}
LABELS = [("succeeded", "", 0.70), ("failed", "user", 0.15), ("lost", "infra", 0.05), ("failed", "preempted", 0.10)]
PROJECTS, USERS, DAYS, BATCH = 10, 40, 90, 5000


def setup_django(attempts_arg: int | None, quick: bool) -> tuple[str, int, callable]:
    """Point Django at a fresh database; return its kind, the size and a clean-up function."""
    database_url = os.environ.get("DATABASE_URL", "")
    cleanup = lambda: None  # noqa: E731
    os.environ["HANGAR_DATA_DIR"] = tempfile.mkdtemp(prefix="hangar-bench-cost-")
    os.environ["HANGAR_MLFLOW"] = "0"
    if database_url.startswith("postgres"):
        import psycopg

        name = f"hangar_bench_{uuid.uuid4().hex[:8]}"
        admin = database_url.rsplit("/", 1)[0] + "/postgres"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        os.environ["DATABASE_URL"] = database_url.rsplit("/", 1)[0] + "/" + name

        def cleanup():
            from django.db import connections

            connections.close_all()
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

        kind, default = "postgresql", 1_000_000
    else:
        os.environ.pop("DATABASE_URL", None)
        kind, default = "sqlite", 300_000
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return kind, attempts_arg or (20_000 if quick else default), cleanup


def seed(total_attempts: int) -> int:
    """Jobs of 1-5 attempts over DAYS days, with JobCost rows and the CostDaily roll-up."""
    from decimal import Decimal

    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from fleet.models import Node
    from jobs.models import Attempt, CostDaily, GpuRate, Job, JobCost
    from portal.models import Membership, Project

    rng = random.Random(6)
    start = timezone.now() - timedelta(days=DAYS)
    users = [get_user_model().objects.create_user(f"user{i}") for i in range(USERS)]
    projects = [Project.objects.create(slug=f"p{i}", name=f"Project {i}") for i in range(PROJECTS)]
    for i, user in enumerate(users):
        Membership.objects.create(project=projects[i % PROJECTS], user=user, role="member")
    owners = [(user.pk, projects[i % PROJECTS].pk) for i, user in enumerate(users)]
    nodes = {t: Node.objects.create(name=f"n-{t.lower()}", gpu_model=t, gpu_count=8) for t in GPU_TYPES}
    for t, price in GPU_TYPES.items():
        GpuRate.objects.create(gpu_type=t, effective_from=start - timedelta(days=1), per_gpu_hour=Decimal(str(price)))

    daily: dict[tuple, list] = {}
    made, next_id = 0, 1
    while made < total_attempts:
        jobs, attempts, costs = [], [], []
        while len(attempts) < BATCH and made < total_attempts:
            job, job_attempts, job_cost = fake_job(rng, next_id, start, owners, nodes, daily)
            jobs.append(job)
            attempts.extend(job_attempts)
            costs.append(job_cost)
            made += len(job_attempts)
            next_id += 1
        Job.objects.bulk_create(jobs)
        Attempt.objects.bulk_create(attempts)
        JobCost.objects.bulk_create(costs)
    CostDaily.objects.bulk_create(
        [CostDaily(**dict(zip(KEYS, k, strict=True)), **dict(zip(FIELDS, v, strict=True))) for k, v in daily.items()],
        batch_size=BATCH,
    )
    return next_id - 1


KEYS = ("day", "project_id", "user_id", "gpu_type", "label")
FIELDS = ("attempts", "gpu_seconds", "preflight_cost", "running_cost", "cost")


def fake_job(rng, job_id, start, owners, nodes, daily):
    from decimal import Decimal

    from jobs.costs import label_for, money
    from jobs.models import Attempt, Job, JobCost

    user_id, project_id = rng.choice(owners)
    gpu_type = rng.choice(list(GPU_TYPES))
    gpus = rng.choice((1, 1, 2, 4, 8))
    at = start + timedelta(seconds=rng.uniform(0, (DAYS - 1) * 86400))
    count = rng.choice((1, 1, 1, 2, 2, 3, 5))
    job = Job(id=job_id, project_id=project_id, submitted_by_id=user_id, name=f"train-{job_id}", command=["python"])
    job.max_runtime_seconds, job.created_at, job.queued_at, job.gpu_type = 86400, at, at, gpu_type
    attempts, totals = [], [0, 0.0, Decimal(0), Decimal(0), Decimal(0), Decimal(0)]
    for number in range(1, count + 1):
        state, fc = ("succeeded", "") if number == count else rng.choices(LABELS, [w for *_, w in LABELS])[0][:2]
        preflight, running = rng.uniform(5, 60), rng.uniform(300, 36000)
        began = at + timedelta(seconds=rng.uniform(1, 120))
        ran, ended = began + timedelta(seconds=preflight), began + timedelta(seconds=preflight + running)
        attempts.append(
            Attempt(
                job_id=job_id, number=number, state=state, failure_class=fc, node=nodes[gpu_type],
                gpu_indices=list(range(gpus)), queued_at=at, scheduled_at=began, started_at=began,
                running_at=ran, finished_at=ended, priced_at=ended,
            )
        )  # fmt: skip
        rate = Decimal(str(GPU_TYPES[gpu_type])) / 3600
        pc, rc = money(gpus * Decimal(preflight) * rate), money(gpus * Decimal(running) * rate)
        label = label_for(state, fc)
        row = daily.setdefault((ended.date(), project_id, user_id, gpu_type, label), [0, 0.0, 0, 0, 0])
        for i, value in enumerate((1, gpus * (preflight + running), pc, rc, pc + rc)):
            row[i] += value
        wasted = pc + rc if label in ("failed", "lost", "preempted") else 0
        for i, value in enumerate((1, gpus * (preflight + running), pc, rc, pc + rc, wasted)):
            totals[i] += value
        at = ended
    job.state, job.finished_at = "succeeded", at
    cost = JobCost(job_id=job_id, project_id=project_id, user_id=user_id, gpu_type=gpu_type)
    cost.attempts, cost.gpu_seconds, cost.preflight_cost, cost.running_cost, cost.cost, cost.wasted_cost = totals
    return job, attempts, cost


def timed(client, url: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        response = client.get(url)
        assert response.status_code == 200, (url, response.status_code)
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def csv_rate(client, url: str) -> tuple[int, float]:
    began = time.perf_counter()
    rows = sum(chunk.count(b"\n") for chunk in client.get(url).streaming_content) - 1
    return rows, rows / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20,000 attempts")
    parser.add_argument("--attempts", type=int, default=None)
    args = parser.parse_args()
    kind, size, cleanup = setup_django(args.attempts, args.quick)
    try:
        from django.contrib.auth import get_user_model
        from django.test import Client

        print(f"seeding {size:,} attempts over {DAYS} days into {kind} (default on {kind}; --attempts N to change)")
        began = time.perf_counter()
        jobs = seed(size)
        print(f"seeded {jobs:,} jobs in {time.perf_counter() - began:.0f}s")
        client = Client()
        client.force_login(get_user_model().objects.create_superuser("bench-admin"))
        runs = 3 if args.quick else 5
        overview = timed(client, "/costs/", runs)
        print(f"cost overview: {overview:.0f} ms (median of {runs})")
        table = timed(client, "/costs/jobs/?project=p3&state=succeeded&gpu_type=H100&sort=-cost&page=3", runs)
        print(f"filtered per-job table page: {table:.0f} ms")
        rows, rate = csv_rate(client, "/costs/jobs.csv")
        print(f"CSV export: {rows:,} rows at {rate:,.0f} rows/s")
        print(
            f"db={kind} attempts={size} jobs={jobs} overview_ms={overview:.0f} "
            f"table_page_ms={table:.0f} csv_rows_per_s={rate:.0f}"
        )
    finally:
        cleanup()


if __name__ == "__main__":
    main()
