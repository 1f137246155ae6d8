"""Scheduler processes racing on one database, for tests/test_sched_race.py:
`setup` fills a fresh database, `race START` runs passes from wall-clock START
(two of them at once), `check` reports the GPUs live attempts hold, `locks` times
rows written beside a pass that holds its locks, `cancel` cancels a job while the
pass places it and its agent starts it. Each prints JSON."""

import json
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from fleet.models import HealthEvent, Node  # noqa: E402
from jobs import scheduler  # noqa: E402
from jobs.models import ACTIVE_ATTEMPT_STATES, Attempt, Job, JobEvent  # noqa: E402
from portal import wakeup  # noqa: E402
from portal.models import Project  # noqa: E402

PASSES = 15


def setup(nodes: int, jobs: int) -> None:
    call_command("migrate", interactive=False, verbosity=0)
    user = get_user_model().objects.create(username="racer")
    project = Project.objects.create(slug="race", name="race")
    now = timezone.now()
    Node.objects.bulk_create(
        Node(name=f"n{i}", gpu_model="H100", gpu_count=8, simulated=True, last_heartbeat_at=now) for i in range(nodes)
    )
    rng = random.Random(3)
    Job.objects.bulk_create(
        Job(project=project, submitted_by=user, name="race", command=["true"], max_runtime_seconds=600,
            gpus_per_node=rng.choice([1, 2, 4, 8]), nodes=rng.choice([1, 1, 1, 2]))
        for _ in range(jobs)
    )  # fmt: skip


def sends_nothing() -> None:
    """No message leaves a pass here: no dispatch to an agent, no wake-up."""
    scheduler.dispatch = lambda *args: None
    wakeup.request_pass = lambda queue_changed=True: None


def hold_the_next_pass(placing: int | None = None) -> tuple[list[int], threading.Event, threading.Event]:
    """The next pass stops after it placed jobs (`placing` of them at most), its node and
    job locks taken and uncommitted, until `go` is set. Returns (placed job ids, held, go)."""
    placed_jobs: list[int] = []
    held, go = threading.Event(), threading.Event()
    start_attempts = scheduler.start_attempts

    def placing_then_held(placements, nodes):
        placed = start_attempts(placements[:placing], nodes)
        placed_jobs.extend(a.job_id for a in placed)
        held.set()
        go.wait(30)
        return placed

    scheduler.start_attempts = placing_then_held
    return placed_jobs, held, go


def in_thread(work, errors: dict[str, str], name: str) -> threading.Thread:
    """Run `work` on a connection of its own; what it raises goes in errors[name]."""

    def run():
        try:
            work()
        except Exception as exc:  # reported: the test names who failed
            errors[name] = repr(exc)[:300]
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def with_lock_timeout(seconds: float, work) -> None:
    """`work` in a transaction that waits at most `seconds` for a lock (then raises)."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL lock_timeout = '{seconds}s'")
        work()


def race(start_at: float) -> None:
    sends_nothing()
    decide = scheduler.plan

    def slow_plan(*args, **kwargs):
        # A slow pass (a big fleet, a loaded database): the window between reading the
        # free GPUs and writing the attempts is where an unlocked pass would collide.
        time.sleep(0.05)
        return decide(*args, **kwargs)

    scheduler.plan = slow_plan
    placed, errors = 0, []
    time.sleep(max(0.0, start_at - time.time()))
    try:
        for _ in range(PASSES):
            placed += len(scheduler.schedule_pass())
            # Free some GPUs so the other pass has new room to fight over.
            for attempt in Attempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES).order_by("?")[:6]:
                attempt.finish("succeeded", exit_code=0)
    except Exception as exc:  # reported, not swallowed: the test fails on it
        errors.append(repr(exc))
    print(json.dumps({"placed": placed, "errors": errors}))


def check() -> None:
    held = [
        (rank["node_id"], gpu)
        for placement in Attempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES).values_list("placement", flat=True)
        for rank in placement
        for gpu in rank["gpus"]
    ]
    print(json.dumps({"held": len(held), "distinct": len(set(held))}))


def locks() -> None:
    """Hold one pass inside its transaction, after it placed jobs (its node and job locks
    taken), and meanwhile write, on another connection, what agents write all the time:
    rows that reference a node and a job the pass locked. Their foreign-key checks take a
    KEY SHARE lock on the referenced row, which a FOR UPDATE lock blocks and a FOR NO KEY
    UPDATE lock does not. Reports each write's wait, or its error under a 2 s lock_timeout."""
    sends_nothing()
    placed_jobs, held, go = hold_the_next_pass()
    passer = in_thread(scheduler.schedule_pass, {}, "pass")
    assert held.wait(30) and placed_jobs, "the pass placed nothing"
    node = Node.objects.order_by("pk").first()
    job = placed_jobs[0]
    writes = {}
    for name, write in [
        ("health_event", lambda: HealthEvent.objects.create(node=node, kind="xid", severity="info", message="m")),
        ("job_event", lambda: JobEvent.objects.create(job_id=job, kind="note", message="m")),
    ]:
        started = time.monotonic()
        try:
            with_lock_timeout(2, write)
            writes[name] = {"waited_ms": round((time.monotonic() - started) * 1000)}
        except Exception as exc:  # reported: the test names the write that waited
            writes[name] = {"error": repr(exc)[:300]}
    go.set()
    passer.join(30)
    print(json.dumps({"placed_job": job, "writes": writes}))


def cancel_while_placed_and_started() -> None:
    """A job cancelled while a pass places it, its attempt then started by its agent (begin:
    the attempt's row, then the job's) while the cancel goes on to that attempt. The pass is
    held after placing; the cancel's first write waits for it; the pass commits; the cancel is
    held before it reads the attempt; the agent begins; the cancel goes on. Reports what each
    of the cancel and the start raised, and how long the start took."""
    sends_nothing()
    placed_jobs, pass_held, pass_go = hold_the_next_pass(placing=1)
    cancel_held, cancel_go = threading.Event(), threading.Event()
    cancel_attempt = Job._cancel_attempt

    def held_cancel(job, reason):
        cancel_held.set()
        cancel_go.wait(30)
        return cancel_attempt(job, reason)

    Job._cancel_attempt = held_cancel
    errors: dict[str, str] = {}
    passer = in_thread(scheduler.schedule_pass, errors, "pass")
    assert pass_held.wait(30) and placed_jobs, "the pass placed nothing"
    job = Job.objects.get(pk=placed_jobs[0])
    canceller = in_thread(lambda: job.cancel(None, "cancelled while placed"), errors, "cancel")
    time.sleep(0.5)  # the cancel's first write waits for the pass's lock on the job
    pass_go.set()
    passer.join(30)
    assert cancel_held.wait(30), "the cancel never got to the attempt"
    attempt = Attempt.objects.get(job_id=job.pk)
    started = time.monotonic()
    starter = in_thread(lambda: with_lock_timeout(5, lambda: attempt.begin(0)), errors, "start")
    time.sleep(0.5)  # the start has its attempt's row, and wants the job's
    cancel_go.set()
    starter.join(30)
    start_took = time.monotonic() - started
    canceller.join(30)
    state = Job.objects.get(pk=job.pk).state
    print(json.dumps({"errors": errors, "start_took_s": round(start_took, 2), "job_state": state}))


if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup(nodes=20, jobs=400)
    elif sys.argv[1] == "race":
        race(float(sys.argv[2]))
    elif sys.argv[1] == "locks":
        locks()
    elif sys.argv[1] == "cancel":
        cancel_while_placed_and_started()
    else:
        check()
