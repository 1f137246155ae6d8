"""How fast is a scheduling pass, and how full does it get the fleet?

An in-memory fleet of 1,000 nodes x 8 GPUs and 10,000 queued jobs of mixed
shapes (1-8 GPUs, gangs of 2-4 nodes) and priority classes; one full pass of
the pure policy (jobs/policy.py), timed. Then the same fleet and queue in the
database and one `schedule_pass()` (load, decide, write attempts), timed: on
PostgreSQL when DATABASE_URL is set (in a fresh database it drops after), on
SQLite in a temporary directory otherwise.

Then, on the warm database, the pass again without and with 1,000 blocked
jobs present (waiting on another job, as pipeline stages do), interleaved, best of 4 each:
they must not slow it.

    python bench/scheduler.py [--quick] [--nodes N] [--jobs N] [--no-db] [--blocked N]

Last line: nodes=.. jobs=.. pass_ms=.. placements=.. placements_per_s=.. gpu_util=.. db=.. db_pass_ms=..
db_placements=.. blocked=.. db_warm_pass_ms=.. db_pass_blocked_ms=.. blocked_ratio=..
"""

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CLASSES = [("urgent", 40, 0.02), ("high", 30, 0.08), ("normal", 20, 0.5), ("low", 10, 0.2), ("scavenger", 0, 0.2)]
SHAPES = [((1, 1), 0.4), ((2, 1), 0.2), ((4, 1), 0.15), ((8, 1), 0.15), ((8, 2), 0.06), ((8, 4), 0.04)]


def workload(nodes: int, jobs: int, seed: int = 7) -> tuple[list[dict], list[dict]]:
    """Plain descriptions of the fleet and the queue, the same for both runs."""
    rng = random.Random(seed)
    fleet = [{"name": f"bench-{i:04d}", "model": "H100" if i % 4 else "B300", "gpus": 8} for i in range(nodes)]
    queue = []
    for i in range(jobs):
        (gpus, count), = rng.choices([s for s, _ in SHAPES], [w for _, w in SHAPES])  # fmt: skip
        (name, rank, _), = rng.choices(CLASSES, [w for *_, w in CLASSES])  # fmt: skip
        queue.append(
            {"id": i + 1, "priority": name, "rank": rank, "gpus": gpus, "nodes": count,
             "gpu_type": rng.choice(["", "", "H100", "B300"]), "runtime": rng.choice([600, 3600, 4 * 3600]),
             "project": i % 4}
        )  # fmt: skip
    queue.sort(key=lambda j: (-j["rank"], j["id"]))
    return fleet, queue


def in_memory(fleet: list[dict], queue: list[dict]) -> tuple[float, int, float]:
    from jobs.policy import FreeNode, QueuedJob, Request, plan

    nodes = [FreeNode(i, n["model"], list(range(n["gpus"])), frozenset(), n["gpus"]) for i, n in enumerate(fleet)]
    jobs = [
        QueuedJob(j["id"], Request(j["gpus"], j["gpu_type"], j["nodes"]), j["project"], 1, j["rank"],
                  j["rank"] >= 30, j["runtime"])
        for j in queue
    ]  # fmt: skip
    started = time.perf_counter()
    result = plan(jobs, nodes)
    seconds = time.perf_counter() - started
    used = sum(len(g) for p in result.placements for _, g in p.ranks)
    return seconds, len(result.placements), used / sum(n["gpus"] for n in fleet)


def fresh_postgres(url: str) -> tuple[str, str]:
    import psycopg

    name = f"hangar_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + "/" + name, name


def drop_postgres(url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def in_database(fleet: list[dict], queue: list[dict], blocked_jobs: int) -> tuple[str, float, int, dict]:
    import django
    from django.core.management import call_command

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from fleet.models import Node
    from jobs import scheduler
    from jobs.models import Attempt, Job
    from portal.models import Project

    call_command("migrate", interactive=False, verbosity=0)
    user = get_user_model().objects.create(username=f"bench-{uuid.uuid4().hex[:6]}")
    projects = [Project.objects.create(slug=f"bench-{uuid.uuid4().hex[:6]}-{i}", name="bench") for i in range(4)]
    now = timezone.now()
    Node.objects.bulk_create(
        Node(name=n["name"], gpu_model=n["model"], gpu_count=n["gpus"], simulated=True, last_heartbeat_at=now)
        for n in fleet
    )
    Job.objects.bulk_create(
        (
            Job(project=projects[j["project"]], submitted_by=user, name="bench", command=["true"],
                gpus_per_node=j["gpus"], nodes=j["nodes"], gpu_type=j["gpu_type"], priority=j["priority"],
                max_runtime_seconds=j["runtime"])
            for j in queue
        ),
        batch_size=2000,
    )  # fmt: skip
    scheduler.dispatch = lambda *args: None  # no agents here: the pass itself is measured
    started = time.perf_counter()
    scheduler.schedule_pass()
    seconds = time.perf_counter() - started
    placed = Attempt.objects.count()
    blocked = with_blocked_jobs(queue, projects, user, blocked_jobs)
    return ("postgresql" if not settings.EMBEDDED_DATABASE else "sqlite"), seconds, placed, blocked


def timed_pass_again() -> tuple[float, int]:
    """The same queue again from scratch: the attempts and history of the last pass undone."""
    from django.utils import timezone

    from fleet.models import Node
    from jobs import scheduler
    from jobs.models import Attempt, Job, JobEvent, JobState

    Node.objects.update(last_heartbeat_at=timezone.now())  # no agents beat here: the nodes stay fresh
    Attempt.objects.all().delete()
    JobEvent.objects.all().delete()
    Job.objects.filter(state=JobState.SCHEDULED).update(state=JobState.QUEUED)
    started = time.perf_counter()
    scheduler.schedule_pass()
    return time.perf_counter() - started, Attempt.objects.count()


def with_blocked_jobs(queue: list[dict], projects, user, count: int, rounds: int = 4) -> dict:
    """The pass again with `count` blocked jobs present (pipeline stages waiting on others) and
    without them, on the warm database, interleaved `rounds` times (best of each: the machine
    may be shared): blocked jobs must cost the pass nothing."""
    from jobs.models import Job, JobState

    if not count:
        return {}
    waits_on = Job.objects.filter(state=JobState.SCHEDULED).values_list("pk", flat=True).first() or 1
    blocked = [
        Job(project=projects[j["project"]], submitted_by=user, name="bench-blocked", command=["true"],
            gpus_per_node=j["gpus"], nodes=j["nodes"], gpu_type=j["gpu_type"], priority=j["priority"],
            max_runtime_seconds=j["runtime"], state=JobState.BLOCKED, state_reason=f"waiting for job {waits_on}",
            depends_on=[{"job": waits_on, "on": "succeeded"}])
        for j in (queue * (count // max(1, len(queue)) + 1))[:count]
    ]  # fmt: skip
    without, with_them, placed, never = [], [], 0, 0
    for _ in range(rounds):
        without.append(timed_pass_again()[0])
        Job.objects.bulk_create([Job(**{f.attname: getattr(j, f.attname) for f in Job._meta.concrete_fields
                                        if f.attname != "id"}) for j in blocked], batch_size=2000)  # fmt: skip
        seconds, placed = timed_pass_again()
        with_them.append(seconds)
        never += Job.objects.filter(state=JobState.BLOCKED).exclude(attempts=None).count()
        Job.objects.filter(state=JobState.BLOCKED).delete()
    best = {"without_ms": min(without) * 1000, "with_ms": min(with_them) * 1000}
    return {**best, "placed": placed, "blocked_placed": never}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 nodes and 2,000 jobs")
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--no-db", action="store_true", help="the in-memory pass only")
    parser.add_argument("--blocked", type=int, default=1000, help="blocked jobs present in a second pass (0: none)")
    args = parser.parse_args()
    nodes = args.nodes or (200 if args.quick else 1000)
    jobs = args.jobs or (2000 if args.quick else 10000)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    admin_url = os.environ.get("DATABASE_URL", "")
    if not admin_url:
        os.environ["HANGAR_DATA_DIR"] = tempfile.mkdtemp(prefix="hangar-bench-sched-")
    fleet, queue = workload(nodes, jobs)
    seconds, placements, util = min(in_memory(fleet, queue) for _ in range(3))
    print(f"in memory: {nodes} nodes x 8 GPUs, {jobs} queued: pass {seconds * 1000:.0f} ms, {placements} placed")
    figures = (
        f"nodes={nodes} jobs={jobs} pass_ms={seconds * 1000:.0f} placements={placements} "
        f"placements_per_s={placements / seconds:.0f} gpu_util={util:.3f}"
    )
    if args.no_db:
        print(figures)
        return
    db_name = None
    if admin_url:
        os.environ["DATABASE_URL"], db_name = fresh_postgres(admin_url)
    try:
        db, db_seconds, db_placed, blocked = in_database(fleet, queue, args.blocked)
    finally:
        if db_name:
            from django.db import connections

            connections.close_all()
            drop_postgres(admin_url, db_name)
    print(f"database ({db}): one schedule_pass() {db_seconds * 1000:.0f} ms, {db_placed} attempts written")
    figures += f" db={db} db_pass_ms={db_seconds * 1000:.0f} db_placements={db_placed}"
    if blocked:
        print(
            f"warm database: pass {blocked['without_ms']:.0f} ms; with {args.blocked} blocked jobs present "
            f"{blocked['with_ms']:.0f} ms ({blocked['placed']} placed, {blocked['blocked_placed']} of them blocked)"
        )
        ratio = blocked["with_ms"] / blocked["without_ms"]
        figures += (
            f" blocked={args.blocked} db_warm_pass_ms={blocked['without_ms']:.0f}"
            f" db_pass_blocked_ms={blocked['with_ms']:.0f} blocked_ratio={ratio:.2f}"
        )
    print(figures)


if __name__ == "__main__":
    main()
