"""GPU-hour rates, budgets and what jobs cost: per job, and rolled up per day."""

from datetime import date, datetime
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, models, transaction
from django.db.models import Q
from django.utils import timezone

from jobs.costs import WASTED_LABELS, BudgetStatus, Rate, attempt_cost
from jobs.models.attempt import Attempt, ranks_of
from jobs.models.job import Job
from portal import statements
from portal.models import Project


class GpuRate(models.Model):
    """The price of one GPU-hour of a GPU type from `effective_from` on (until the next rate)."""

    gpu_type = models.CharField(max_length=64)
    effective_from = models.DateTimeField()
    per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)
    note = models.CharField(max_length=200, blank=True, help_text="e.g. that it is an example rate to replace.")

    class Meta:
        ordering = ["gpu_type", "effective_from"]
        constraints = [models.UniqueConstraint(fields=["gpu_type", "effective_from"], name="one_rate_per_moment")]

    def __str__(self) -> str:
        return f"{self.gpu_type} {self.per_gpu_hour}/GPU-hour from {self.effective_from:%Y-%m-%d %H:%M}"

    EXAMPLE_NOTE = "example rate seeded at first start: replace it with what your GPUs cost"
    # Per GPU-hour, roughly what clouds asked in 2026; only for a fleet with no rate at all.
    EXAMPLES = {"H100": "2.50", "H200": "3.50", "B300": "6.00", "A100": "1.50", "L40S": "0.90"}

    @classmethod
    def seed_examples(cls) -> list[str]:
        """On a fleet with no rate at all, example rates for the common GPU types (labelled so)."""
        if cls.objects.exists():
            return []
        since = timezone.now().replace(year=2000, month=1, day=1, hour=0, minute=0, second=0, microsecond=0)
        cls.objects.bulk_create(
            cls(gpu_type=t, effective_from=since, per_gpu_hour=p, note=cls.EXAMPLE_NOTE)
            for t, p in cls.EXAMPLES.items()
        )
        return list(cls.EXAMPLES)

    @classmethod
    def examples_in_force(cls, gpu_types) -> list[str]:
        """Of these GPU types, those whose rate in force now is a seeded example."""
        now, latest = timezone.now(), {}
        for gpu_type, note in cls.objects.filter(gpu_type__in=list(gpu_types), effective_from__lte=now).values_list(
            "gpu_type", "note"
        ):  # ordered by type, then effective_from: the last one per type is in force
            latest[gpu_type] = note
        return sorted(t for t, note in latest.items() if note == cls.EXAMPLE_NOTE)

    @classmethod
    def unpriced(cls, gpu_types) -> list[str]:
        """Of these GPU types, those with no rate: their GPU time costs nothing."""
        priced = set(cls.objects.filter(gpu_type__in=list(gpu_types)).values_list("gpu_type", flat=True))
        return sorted(set(gpu_types) - priced)

    @classmethod
    def rates_for(cls, gpu_type: str) -> list:
        return [Rate(start, price) for start, price in rates_of.rows(gpu_type=gpu_type)]


class Budget(models.Model):
    """A project's spending budget for one month (or every month, when `month` is blank)."""

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="budgets")
    month = models.DateField(null=True, blank=True, help_text="First day of the month; blank: every month.")
    amount = models.DecimalField(max_digits=14, decimal_places=2)
    warn_percent = models.PositiveSmallIntegerField(default=80, help_text="Warn from this share of the amount on.")
    hard_limit = models.BooleanField(default=False, help_text="Refuse new jobs once the amount is spent.")

    class Meta:
        ordering = ["project", "month"]
        constraints = [models.UniqueConstraint(fields=["project", "month"], name="one_budget_per_project_month")]

    def __str__(self) -> str:
        return f"{self.project.slug} {self.month:%Y-%m}" if self.month else f"{self.project.slug} monthly"

    @classmethod
    def applying(cls, day) -> models.QuerySet:
        """Budgets that apply in the month of `day`: that month's own, and every-month ones."""
        return cls.objects.filter(Q(month=day.replace(day=1)) | Q(month=None))

    @classmethod
    def for_month(cls, project_id: int, day) -> "Budget | None":
        budgets = cls.applying(day).filter(project_id=project_id)
        return budgets.select_related("project").order_by(models.F("month").desc(nulls_last=True)).first()

    def status(self, day):
        """Spend of the month that holds `day` against this budget."""
        month = day.replace(day=1)
        spent = CostDaily.objects.filter(project_id=self.project_id, day__gte=month, day__lt=next_month(month))
        total = spent.aggregate(s=models.Sum("cost"))["s"] or 0
        name = f"'{self.project.slug} {month:%Y-%m}'"
        return BudgetStatus(name, self.amount, total, self.warn_percent, self.hard_limit)


def next_month(month):
    return month.replace(year=month.year + 1, month=1) if month.month == 12 else month.replace(month=month.month + 1)


class JobCost(models.Model):
    """A job's cost over its finished attempts, kept up to date as each one ends."""

    job = models.OneToOneField(Job, on_delete=models.CASCADE, primary_key=True, related_name="cost")
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    gpu_type = models.CharField(max_length=64)
    attempts = models.PositiveIntegerField(default=0)
    gpu_seconds = models.FloatField(default=0)
    preflight_cost = models.DecimalField(max_digits=14, decimal_places=4, default=0)
    running_cost = models.DecimalField(max_digits=14, decimal_places=4, default=0)
    cost = models.DecimalField(max_digits=14, decimal_places=4, default=0, db_index=True)
    wasted_cost = models.DecimalField(
        max_digits=14, decimal_places=4, default=0, help_text="Of failed, lost and preempted attempts."
    )

    class Meta:
        indexes = [models.Index(fields=["project", "cost"]), models.Index(fields=["gpu_type", "cost"])]

    @classmethod
    def record_attempt(cls, attempt_id: int) -> int | None:
        """Add an ended attempt to its job's cost and the day's roll-up, once (jobs/settling.py;
        in the caller's transaction): its job's id, or None when it has not ended or was priced
        already. Its job's earlier attempts may be priced after it, in another process: the
        job's row is made by whichever comes first."""
        if not attempt_marked_priced.update(pk=attempt_id, now=timezone.now()):
            return None
        row = attempt_priced.first(pk=attempt_id)
        state, failure_class, started_at, running_at, finished_at, placement, node_id, gpu_indices = row[:8]
        gpu_type, job_id, project_id, user_id, gpus_per_node, nodes = row[8:]
        c = attempt_cost(
            gpus_of(ranks_of(placement, node_id, gpu_indices), gpus_per_node * nodes),
            started_at,
            running_at,
            finished_at,
            GpuRate.rates_for(gpu_type),
            timezone.now(),
            state,
            failure_class,
        )
        keys = {"project_id": project_id, "user_id": user_id, "gpu_type": gpu_type}
        wasted = c.cost if c.label in WASTED_LABELS else Decimal(0)
        added = {
            "attempts": 1,
            "gpu_seconds": c.gpu_seconds,
            "preflight_cost": c.preflight_cost,
            "running_cost": c.running_cost,
            "cost": c.cost,
            "wasted_cost": wasted,
        }
        add_to_row(cls, {"job_id": job_id}, added, keys, also_set={"gpu_type": gpu_type}, adds=job_cost_added)
        CostDaily.add(day=finished_at.date(), label=c.label, cost=c, **keys)
        return job_id


def add_to_row(
    model,
    key: dict,
    added: dict,
    create_with: dict,
    also_set: dict | None = None,
    adds: statements.Statement | None = None,
) -> None:
    """Add `added` to the row of `model` at `key`, creating it (with `create_with`) when there is
    none: one UPDATE where the row exists, as it does for all but a job's or a day's first
    attempt. Two writers creating the same row at once: the one that loses adds to the other's.
    `adds`: the UPDATE as a compiled statement of the key's, added and set values."""

    def add() -> int:
        if adds is not None:
            return adds.update(**key, **added, **(also_set or {}))
        return model.objects.filter(**key).update(**_increments(**added), **(also_set or {}))

    if add():
        return
    try:
        with transaction.atomic():  # a savepoint: a lost race must not abort the caller's transaction
            model.objects.create(**key, **create_with, **added)
    except IntegrityError:
        add()


def gpus_of(ranks: list[dict], job_gpus: int) -> int:
    """The GPUs an attempt holds: every rank's (the job's count for an attempt with none listed)."""
    return sum(len(rank["gpus"]) for rank in ranks) or job_gpus


def attempt_cost_of(attempt: "Attempt", now=None, rates: list | None = None):
    """The cost of one attempt (so far, while it runs) at the rates of its node's GPU type
    (`rates`, when the caller has loaded them already)."""
    return attempt_cost(
        gpus_of(attempt.ranks, attempt.job.gpus),
        attempt.started_at,
        attempt.running_at,
        attempt.finished_at,
        GpuRate.rates_for(attempt.node.gpu_model) if rates is None else rates,
        now or timezone.now(),
        attempt.state,
        attempt.failure_class,
    )


class CostDaily(models.Model):
    """Spend per day, project, user, GPU type and label (succeeded, failed, lost, preempted, cancelled).

    An attempt counts on the day it finished. The cost pages aggregate this
    table, never the attempts, so they stay fast however many attempts there are.
    """

    day = models.DateField()
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    gpu_type = models.CharField(max_length=64)
    label = models.CharField(max_length=16)
    attempts = models.PositiveIntegerField(default=0)
    gpu_seconds = models.FloatField(default=0)
    preflight_cost = models.DecimalField(max_digits=16, decimal_places=4, default=0)
    running_cost = models.DecimalField(max_digits=16, decimal_places=4, default=0)
    cost = models.DecimalField(max_digits=16, decimal_places=4, default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["day", "project", "user", "gpu_type", "label"], name="one_cost_row_per_day")
        ]
        indexes = [models.Index(fields=["project", "day"])]

    @classmethod
    def add(cls, day, project_id: int, user_id: int, gpu_type: str, label: str, cost) -> None:
        key = {"day": day, "project_id": project_id, "user_id": user_id, "gpu_type": gpu_type, "label": label}
        added = {
            "attempts": 1,
            "gpu_seconds": cost.gpu_seconds,
            "preflight_cost": cost.preflight_cost,
            "running_cost": cost.running_cost,
            "cost": cost.cost,
        }
        add_to_row(cls, key, added, {}, adds=day_cost_added)


def _increments(**added) -> dict:
    return {field: models.F(field) + value for field, value in added.items()}


@statements.update
def job_cost_added(
    job_id: int,
    gpu_type: str,
    attempts: int,
    gpu_seconds: float,
    preflight_cost: Decimal,
    running_cost: Decimal,
    cost: Decimal,
    wasted_cost: Decimal,
):
    """An attempt added to its job's cost."""
    added = _increments(
        attempts=attempts,
        gpu_seconds=gpu_seconds,
        preflight_cost=preflight_cost,
        running_cost=running_cost,
        cost=cost,
        wasted_cost=wasted_cost,
    )
    return JobCost.objects.filter(job_id=job_id), {**added, "gpu_type": gpu_type}


@statements.update
def day_cost_added(
    day: date,
    project_id: int,
    user_id: int,
    gpu_type: str,
    label: str,
    attempts: int,
    gpu_seconds: float,
    preflight_cost: Decimal,
    running_cost: Decimal,
    cost: Decimal,
):
    """An attempt added to its day's roll-up."""
    key = {"day": day, "project_id": project_id, "user_id": user_id, "gpu_type": gpu_type, "label": label}
    added = _increments(
        attempts=attempts, gpu_seconds=gpu_seconds, preflight_cost=preflight_cost, running_cost=running_cost, cost=cost
    )
    return CostDaily.objects.filter(**key), added


@statements.query
def rates_of(gpu_type: str):
    """A GPU type's rates, each with the day it took effect."""
    return GpuRate.objects.filter(gpu_type=gpu_type).values_list("effective_from", "per_gpu_hour")


@statements.update
def attempt_marked_priced(pk: int, now: datetime):
    """An ended attempt's cost, about to be added: marked so, unless it was already."""
    return Attempt.objects.filter(pk=pk, priced_at=None, finished_at__isnull=False), {"priced_at": now}


@statements.query
def attempt_priced(pk: int):
    """What an attempt's price is made of (its times, its GPUs and their type, its end) and
    where it is added (its job, project and user)."""
    priced = ("state", "failure_class", "started_at", "running_at", "finished_at", "placement", "node_id")
    priced += ("gpu_indices", "node__gpu_model", "job_id", "job__project_id", "job__submitted_by_id")
    priced += ("job__gpus_per_node", "job__nodes")
    return Attempt.objects.filter(pk=pk).values_list(*priced)[:1]
