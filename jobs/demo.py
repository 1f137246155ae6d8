"""The living demo (`manage.py demo`): a simulated fleet, teams, rates, budgets, a week of cost
history and a generator of a realistic job mix, so that every page has life within a minute.

The fleet is real agents on simulated GPUs; the jobs are real processes (small Python
scripts that print progress, sleep and exit), submitted through `submit_job` like any other.
"""

import logging
import random
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from django.contrib.auth import get_user_model
from django.db import DatabaseError, close_old_connections
from django.utils import timezone

from fleet.models import FaultInjection, Node, NodeState
from jobs.api.serializers import JobSubmitSerializer
from jobs.models import Budget, Channel, CostDaily, Event, GpuRate, Job, JobState, Subscription
from jobs.submission import submit_job
from portal.models import Membership, Project, Role

log = logging.getLogger("hangar.demo")


@dataclass(frozen=True)
class DemoNode:
    name: str
    model: str
    gpus: int


FLEET = [
    *[DemoNode(f"h100-{i}", "H100", 8) for i in range(1, 5)],
    *[DemoNode(f"a100-{i}", "A100", 4) for i in range(1, 5)],
]
FAULTY_NODE = "a100-4"  # an ECC fault is injected here: the health policy cordons it
RATES = {"H100": Decimal("2.49"), "A100": Decimal("1.29")}
TEAMS = {
    # project: (name, members {username: role}, monthly budget, GPU quota, daily GPU-hours of history)
    "vision": ("Vision", {"alice": Role.MANAGER, "bob": Role.MEMBER}, Decimal("6000"), 24, 16.0),
    "nlp": ("Language models", {"carol": Role.MANAGER, "bob": Role.MEMBER}, Decimal("4000"), 16, 11.0),
    # A small budget, already mostly spent: its warning shows, and budget notifications fire.
    "agents": ("Agent experiments", {"agent-7": Role.MEMBER, "alice": Role.MEMBER}, Decimal("25"), 8, 2.0),
}


# --- what the demo starts with ---------------------------------------------------------


def seed() -> None:
    """Teams, rates, budgets and a week of spend; safe to run again (a restarted demo)."""
    users = get_user_model().objects
    week_ago = timezone.now() - timedelta(days=30)
    for gpu_type, price in RATES.items():
        GpuRate.objects.get_or_create(gpu_type=gpu_type, effective_from=week_ago, defaults={"per_gpu_hour": price})
    for slug, (name, members, budget, quota, _) in TEAMS.items():
        project, _ = Project.objects.get_or_create(slug=slug, defaults={"name": name, "gpu_quota": quota})
        Budget.objects.get_or_create(project=project, month=None, defaults={"amount": budget, "warn_percent": 80})
        for username, role in members.items():
            user, made = users.get_or_create(username=username, defaults={"email": f"{username}@demo.invalid"})
            if made:
                user.set_password(f"demo-{username}")
                user.save(update_fields=["password"])
            Membership.objects.get_or_create(project=project, user=user, defaults={"role": role})
        for admin in users.filter(is_superuser=True):
            Membership.objects.get_or_create(project=project, user=admin, defaults={"role": Role.ADMIN})
    if not CostDaily.objects.exists():
        cost_history()
    # The notifications page has deliveries to show: e-mail, on the console in the embedded default.
    for admin in users.filter(is_superuser=True):
        Subscription.objects.get_or_create(
            user=admin,
            channel=Channel.EMAIL,
            defaults={"email": "ops@demo.invalid", "events": [Event.NODE_CORDONED, Event.BUDGET_THRESHOLD]},
        )


def cost_history(days: int = 7) -> None:
    """Today (so far) and the six days before: spend per team, user and GPU type, with some waste."""
    rng = random.Random(22)
    today = timezone.localdate()
    rows = []
    for back in range(days):
        day = today - timedelta(days=back)
        for slug, (_, members, _, _, daily_hours) in TEAMS.items():
            project = Project.objects.get(slug=slug)
            for username in members:
                user = get_user_model().objects.get(username=username)
                for gpu_type, price in RATES.items():
                    for label, share in (("succeeded", 1.0), ("failed", 0.12), ("preempted", 0.06)):
                        hours = rng.uniform(0.5, 1.5) * daily_hours * share
                        cost = Decimal(hours * float(price)).quantize(Decimal("0.0001"))
                        rows.append(
                            CostDaily(
                                day=day,
                                project=project,
                                user=user,
                                gpu_type=gpu_type,
                                label=label,
                                attempts=max(1, int(hours / 2)),
                                gpu_seconds=hours * 3600,
                                preflight_cost=cost * Decimal("0.02"),
                                running_cost=cost * Decimal("0.98"),
                                cost=cost,
                            )
                        )
    CostDaily.objects.bulk_create(rows, ignore_conflicts=True)


# --- the job mix ---------------------------------------------------------------------------

TRAIN = """
import math, random, sys, time
steps, pause, fail_at = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
print(f"starting: {steps} steps", flush=True)
for step in range(1, steps + 1):
    loss = 2.5 * math.exp(-step / (steps / 3)) + random.uniform(0, 0.05)
    print(f"step {step}/{steps} loss={loss:.4f} lr=3e-4 tokens/s={random.randint(9000, 11000)}", flush=True)
    if step == fail_at:
        print("Traceback (most recent call last):", file=sys.stderr)
        print('  File "train.py", line 88, in <module>', file=sys.stderr)
        print("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr, flush=True)
        sys.exit(1)
    time.sleep(pause)
print("done: checkpoint saved", flush=True)
"""


def spec(project: str, name: str, seconds: float, gpus: int = 1, nodes: int = 1, fail: bool = False, **extra) -> dict:
    steps = max(2, int(seconds // 2))
    argv = [sys.executable, "-c", TRAIN, str(steps), str(seconds / steps), str(steps // 2 if fail else 0)]
    return {
        "project": project,
        "name": name,
        "command": argv,
        "gpus_per_node": gpus,
        "nodes": nodes,
        "max_runtime_seconds": int(seconds * 3 + 60),
        **extra,
    }


OPENING = [
    # Long low-priority work that fills the H100s, and is preempted later.
    ("alice", spec("vision", "vit-pretrain", 900, gpus=8, priority="low", gpu_type="H100")),
    ("bob", spec("vision", "detr-finetune", 900, gpus=8, priority="low", gpu_type="H100")),
    ("carol", spec("nlp", "llama-8b-sft (2 nodes)", 600, gpus=8, nodes=2, gpu_type="H100")),
    # A sweep: one spec, six learning rates.
    *[
        ("agent-7", spec("agents", f"sweep lr={lr}", 25 + 10 * i, gpu_type="A100", config={"lr": lr}))
        for i, lr in enumerate(["1e-4", "3e-4", "1e-3", "3e-3", "1e-2", "3e-2"])
    ],
    ("bob", spec("nlp", "tokenizer-eval", 8)),
    ("alice", spec("vision", "augment-ablation", 20, fail=True, gpu_type="A100")),
    ("carol", spec("nlp", "rlhf-reward-model", 400, gpus=4, gpu_type="A100")),
    # More than fits: a queue with reasons to wait.
    *[("bob", spec("vision", f"resnet-depth-{d}", 120, gpus=8, gpu_type="H100")) for d in (50, 101, 152)],
]
LATER = [
    # (seconds after start, what happens)
    (15, "fault"),
    (25, "preempt"),
]


def submit(username: str, job_spec: dict) -> Job | None:
    user = get_user_model().objects.get(username=username)
    checked = JobSubmitSerializer(data=job_spec)
    if not checked.is_valid():
        log.warning("demo job %s refused: %s", job_spec["name"], checked.errors)
        return None
    try:
        return submit_job(user, checked.validated_data).job
    except Exception as exc:  # a refusal (budget, capacity) is the demo's news, not its end
        log.warning("demo job %s refused: %s", job_spec["name"], exc)
        return None


def inject_fault() -> None:
    node = Node.objects.filter(name=FAULTY_NODE).first()
    if node is not None and node.state == NodeState.READY:
        FaultInjection.objects.create(node=node, kind="ecc", gpu_index=1)


class Generator:
    """Submits the opening mix, then keeps a steady trickle: short runs, the odd failure, evals."""

    def __init__(self, seed_value: int = 7):
        self.rng = random.Random(seed_value)
        self.stop = threading.Event()
        self.started = time.monotonic()
        self.done: set[str] = set()

    def run(self) -> None:
        for username, job_spec in OPENING:
            submit(username, job_spec)
        tick = 0
        while not self.stop.wait(3.0):
            tick += 1
            try:
                self.step(tick)
            except DatabaseError as exc:
                log.warning("demo generator: %s", exc)
            except Exception:
                log.exception("demo generator")
            finally:
                close_old_connections()

    def step(self, tick: int) -> None:
        elapsed = time.monotonic() - self.started
        for at, what in LATER:
            if elapsed >= at and what not in self.done:
                self.done.add(what)
                if what == "fault":
                    inject_fault()
                else:
                    submit("carol", spec("nlp", "urgent: eval before the review", 60, gpus=8, priority="urgent"))
        if Job.objects.filter(state=JobState.QUEUED).count() > 12:
            return  # enough waiting: let the fleet catch up
        username, project = self.rng.choice([("alice", "vision"), ("bob", "nlp"), ("agent-7", "agents")])
        if tick % 7 == 0:
            submit(username, spec(project, f"flaky-data-loader-{tick}", 10, fail=True))
        elif tick % 5 == 0:
            submit(username, spec(project, f"finetune-{tick}", self.rng.randint(60, 240), gpus=4, gpu_type="H100"))
        else:
            submit(username, spec(project, f"eval-{tick}", self.rng.randint(5, 30), gpus=self.rng.choice([1, 1, 2])))
