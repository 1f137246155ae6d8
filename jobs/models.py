"""Jobs, their attempts, their log lines and their history.

The database row is the record of a job's state. Every state change is a
conditional update on the current state, so a transition applied twice (a
retried message, two schedulers, a late agent) takes effect once.
"""

from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from portal.models import AuditEvent, Project


class JobState(models.TextChoices):
    QUEUED = "queued", "Queued"
    SCHEDULED = "scheduled", "Scheduled"
    PREFLIGHT = "preflight", "Preflight"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"

    @property
    def colour(self) -> str:
        return STATE_COLOURS[self.value]


class AttemptState(models.TextChoices):
    SCHEDULED = "scheduled", "Scheduled"
    PREFLIGHT = "preflight", "Preflight"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    LOST = "lost", "Lost"

    @property
    def colour(self) -> str:
        return STATE_COLOURS[self.value]


STATE_COLOURS = {
    "queued": "grey",
    "scheduled": "blue",
    "preflight": "blue",
    "running": "blue",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "orange",
    "lost": "red",
}

FINAL_JOB_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
ACTIVE_ATTEMPT_STATES = (AttemptState.SCHEDULED, AttemptState.PREFLIGHT, AttemptState.RUNNING)
STARTED_ATTEMPT_STATES = (AttemptState.PREFLIGHT, AttemptState.RUNNING)


class FailureClass(models.TextChoices):
    USER = "user", "User (the command failed)"
    INFRA = "infra", "Infrastructure (node, GPU, agent)"
    PREEMPTED = "preempted", "Preempted"
    TIMEOUT = "timeout", "Timed out"
    CANCELLED = "cancelled", "Cancelled"


class Priority(models.TextChoices):
    URGENT = "urgent", "Urgent"
    HIGH = "high", "High"
    NORMAL = "normal", "Normal"
    LOW = "low", "Low"
    SCAVENGER = "scavenger", "Scavenger"

    @property
    def rank(self) -> int:
        """Higher goes first."""
        return {"urgent": 40, "high": 30, "normal": 20, "low": 10, "scavenger": 0}[self.value]


class JobQuerySet(models.QuerySet):
    def visible_to(self, user) -> "JobQuerySet":
        return self.filter(project__in=Project.objects.visible_to(user))


class Job(models.Model):
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="jobs")
    submitted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=200)
    command = models.JSONField(help_text="argv list; run as is, never through a shell.")
    env = models.JSONField(default=dict, blank=True)
    gpus_per_node = models.PositiveSmallIntegerField(default=1)
    nodes = models.PositiveSmallIntegerField(default=1)
    gpu_type = models.CharField(max_length=64, blank=True, help_text="Blank: any GPU type.")
    priority = models.CharField(max_length=16, choices=Priority.choices, default=Priority.NORMAL)
    max_runtime_seconds = models.PositiveIntegerField()
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED, db_index=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    queued_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    failure_class = models.CharField(max_length=16, choices=FailureClass.choices, blank=True)
    state_reason = models.TextField(blank=True)
    requeues = models.PositiveIntegerField(default=0, help_text="Times requeued after an infrastructure failure.")
    # What reproduces the job, and its MLflow run (jobs/tracking.py).
    code_version = models.CharField(max_length=200, blank=True, help_text="e.g. a git commit.")
    environment = models.CharField(max_length=200, blank=True, help_text="Environment or image name.")
    config = models.JSONField(default=dict, blank=True)
    data_refs = models.JSONField(default=list, blank=True)
    mlflow_experiment_id = models.CharField(max_length=64, blank=True)
    mlflow_run_id = models.CharField(max_length=64, blank=True)
    tracking_error = models.TextField(blank=True, help_text="Why metrics are unavailable, when they are.")

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name}"

    @property
    def state_colour(self) -> str:
        return STATE_COLOURS[self.state]

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_JOB_STATES

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def latest_attempt(self) -> "Attempt | None":
        return self.attempts.order_by("-number").first()

    def cancel(self, by, reason: str = "") -> bool:
        """Cancel the job. A queued or not yet started job ends now; a started one
        is asked to stop and its agent ends it (SIGTERM, grace, SIGKILL)."""
        reason = reason or f"cancelled by {by}"
        with transaction.atomic():
            if Job.objects.filter(pk=self.pk, state=JobState.QUEUED).update(
                state=JobState.CANCELLED,
                finished_at=timezone.now(),
                failure_class=FailureClass.CANCELLED,
                state_reason=reason,
            ):
                done = True
            else:
                done = self._cancel_attempt(reason)
            if done:
                AuditEvent.record(by, "job.cancel", self, reason=reason)
                JobEvent.objects.create(job=self, kind="cancel", message=reason)
        self.refresh_from_db()
        return done

    def _cancel_attempt(self, reason: str) -> bool:
        attempt = self.attempts.filter(state__in=ACTIVE_ATTEMPT_STATES).first()
        if attempt is None:
            return False
        if attempt.finish(AttemptState.CANCELLED, FailureClass.CANCELLED, reason, from_states=[AttemptState.SCHEDULED]):
            return True
        return bool(
            Attempt.objects.filter(pk=attempt.pk, state__in=STARTED_ATTEMPT_STATES, cancel_requested_at=None).update(
                cancel_requested_at=timezone.now(), reason=reason
            )
        )


class Attempt(models.Model):
    """One try of a job on a concrete placement (a node and GPU indices)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveSmallIntegerField()
    state = models.CharField(max_length=16, choices=AttemptState.choices, default=AttemptState.SCHEDULED)
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="attempts")
    gpu_indices = models.JSONField(default=list)
    queued_at = models.DateTimeField()
    scheduled_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True, help_text="The agent took it: preflight began.")
    running_at = models.DateTimeField(null=True, blank=True, help_text="The command started.")
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    failure_class = models.CharField(max_length=16, choices=FailureClass.choices, blank=True)
    reason = models.TextField(blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="attempt_number_unique"),
            # The database itself refuses a second live attempt of one job.
            models.UniqueConstraint(
                fields=["job"], condition=Q(state__in=["scheduled", "preflight", "running"]), name="one_live_attempt"
            ),
        ]
        indexes = [models.Index(fields=["state", "node"])]

    def __str__(self) -> str:
        return f"attempt {self.number} of job {self.job_id}"

    @property
    def state_colour(self) -> str:
        return STATE_COLOURS[self.state]

    @property
    def is_live(self) -> bool:
        return self.state in ACTIVE_ATTEMPT_STATES

    def preflight_seconds(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.running_at or self.finished_at or timezone.now()
        return (end - self.started_at).total_seconds()

    def running_seconds(self) -> float | None:
        if self.running_at is None:
            return None
        return ((self.finished_at or timezone.now()) - self.running_at).total_seconds()

    def begin(self) -> bool:
        """The agent takes the attempt: scheduled -> preflight. False if it is no longer current."""
        now = timezone.now()
        with transaction.atomic():
            took = Attempt.objects.filter(pk=self.pk, state=AttemptState.SCHEDULED).update(
                state=AttemptState.PREFLIGHT, started_at=now, lease_expires_at=lease_from(now)
            )
            if took:
                Job.objects.filter(pk=self.job_id, state=JobState.SCHEDULED).update(state=JobState.PREFLIGHT)
        return bool(took)

    def mark_running(self, pid: int) -> bool:
        now = timezone.now()
        with transaction.atomic():
            ok = Attempt.objects.filter(pk=self.pk, state=AttemptState.PREFLIGHT).update(
                state=AttemptState.RUNNING, running_at=now, pid=pid, lease_expires_at=lease_from(now)
            )
            if ok:
                Job.objects.filter(pk=self.job_id, state=JobState.PREFLIGHT).update(state=JobState.RUNNING)
        return bool(ok)

    def finish(
        self,
        state: str,
        failure_class: str = "",
        reason: str = "",
        exit_code: int | None = None,
        from_states=ACTIVE_ATTEMPT_STATES,
    ) -> bool:
        """End the attempt and move its job on. Refused (False) once the attempt is no longer current."""
        now = timezone.now()
        with transaction.atomic():
            ended = Attempt.objects.filter(pk=self.pk, state__in=from_states).update(
                state=state,
                failure_class=failure_class,
                reason=reason,
                exit_code=exit_code,
                finished_at=now,
                lease_expires_at=None,
            )
            if not ended:
                return False
            self.state, self.failure_class, self.reason, self.exit_code = state, failure_class, reason, exit_code
            self._move_job_on(now)
            JobCost.record_attempt(self.pk)
            from jobs.scheduler import request_pass

            request_pass()  # its GPUs are free, and the job may be queued again
        return True

    def _move_job_on(self, now) -> None:
        job = Job.objects.select_for_update().get(pk=self.job_id)
        if job.is_final:
            return
        requeue = self.failure_class == FailureClass.INFRA and job.requeues < settings.HANGAR_MAX_REQUEUES
        if self.state == AttemptState.CANCELLED or self._cancel_was_requested():
            update = {"state": JobState.CANCELLED, "failure_class": FailureClass.CANCELLED}
        elif requeue:
            update = {"state": JobState.QUEUED, "queued_at": now, "requeues": job.requeues + 1}
        elif self.state == AttemptState.SUCCEEDED:
            update = {"state": JobState.SUCCEEDED, "failure_class": ""}
        else:
            update = {"state": JobState.FAILED, "failure_class": self.failure_class}
        if update["state"] != JobState.QUEUED:
            update.update(finished_at=now, exit_code=self.exit_code)
        update["state_reason"] = self.reason
        Job.objects.filter(pk=job.pk).update(**update)
        kind = "requeue" if requeue else update["state"]
        JobEvent.objects.create(job_id=job.pk, attempt=self, kind=kind, message=self.reason)

    def _cancel_was_requested(self) -> bool:
        # Read again: a cancel may have been asked after this object was loaded.
        return Attempt.objects.filter(pk=self.pk, cancel_requested_at__isnull=False).exists()

    @classmethod
    def expire_leases(cls) -> list["Attempt"]:
        """End started attempts whose agent stopped renewing their lease (lost, infra)."""
        now = timezone.now()
        expired = list(cls.objects.filter(state__in=STARTED_ATTEMPT_STATES, lease_expires_at__lt=now))
        return [a for a in expired if a.finish(AttemptState.LOST, FailureClass.INFRA, "lease expired: agent silent")]

    @classmethod
    def expire_unstarted(cls) -> list["Attempt"]:
        """Requeue attempts no agent took in time (a lost message, a dead agent)."""
        cutoff = timezone.now() - timedelta(seconds=settings.HANGAR_START_TIMEOUT_SECONDS)
        stale = list(cls.objects.filter(state=AttemptState.SCHEDULED, scheduled_at__lt=cutoff))
        reason = f"no agent started it within {settings.HANGAR_START_TIMEOUT_SECONDS:.0f}s"
        return [
            a
            for a in stale
            if a.finish(AttemptState.LOST, FailureClass.INFRA, reason, from_states=[AttemptState.SCHEDULED])
        ]


def lease_from(now):
    return now + timedelta(seconds=settings.HANGAR_LEASE_SECONDS)


class JobEvent(models.Model):
    """The history of a job: submitted, scheduled, started, ended, cancelled, requeued."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    attempt = models.ForeignKey(Attempt, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=32)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["at", "id"]


class Stream(models.IntegerChoices):
    SYSTEM = 0, "hangar"
    STDOUT = 1, "stdout"
    STDERR = 2, "stderr"


class Severity(models.IntegerChoices):
    DEBUG = 10, "DEBUG"
    INFO = 20, "INFO"
    WARNING = 30, "WARNING"
    ERROR = 40, "ERROR"
    CRITICAL = 50, "CRITICAL"


class LogLine(models.Model):
    """One line of a job's output. `seq` counts from 1 within its attempt, with no gaps."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_lines")
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="log_lines")
    node = models.ForeignKey("fleet.Node", null=True, on_delete=models.SET_NULL, related_name="+")
    rank = models.PositiveSmallIntegerField(default=0)
    seq = models.PositiveIntegerField()
    stream = models.PositiveSmallIntegerField(choices=Stream.choices)
    severity = models.PositiveSmallIntegerField(choices=Severity.choices, default=Severity.INFO)
    ts = models.DateTimeField()
    text = models.TextField()

    class Meta:
        ordering = ["attempt_id", "seq"]
        constraints = [models.UniqueConstraint(fields=["attempt", "seq"], name="log_seq_unique")]

    @classmethod
    def after(cls, job_id: int, attempt_id: int, seq: int) -> models.QuerySet:
        """Lines of a job after a cursor (attempt id, seq), in order."""
        return (
            cls.objects.filter(job_id=job_id)
            .filter(Q(attempt_id__gt=attempt_id) | Q(attempt_id=attempt_id, seq__gt=seq))
            .order_by("attempt_id", "seq")
        )


# --- Cost: rates, budgets and the roll-ups kept as attempts finish ----------


class GpuRate(models.Model):
    """The price of one GPU-hour of a GPU type from `effective_from` on (until the next rate)."""

    gpu_type = models.CharField(max_length=64)
    effective_from = models.DateTimeField()
    per_gpu_hour = models.DecimalField(max_digits=12, decimal_places=4)

    class Meta:
        ordering = ["gpu_type", "effective_from"]
        constraints = [models.UniqueConstraint(fields=["gpu_type", "effective_from"], name="one_rate_per_moment")]

    def __str__(self) -> str:
        return f"{self.gpu_type} {self.per_gpu_hour}/GPU-hour from {self.effective_from:%Y-%m-%d %H:%M}"

    @classmethod
    def rates_for(cls, gpu_type: str) -> list:
        from jobs.costs import Rate

        rows = cls.objects.filter(gpu_type=gpu_type).values_list("effective_from", "per_gpu_hour")
        return [Rate(start, price) for start, price in rows]


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
    def for_month(cls, project_id: int, day) -> "Budget | None":
        month = day.replace(day=1)
        budgets = cls.objects.filter(project_id=project_id).filter(Q(month=month) | Q(month=None))
        return budgets.select_related("project").order_by(models.F("month").desc(nulls_last=True)).first()

    def status(self, day):
        """Spend of the month that holds `day` against this budget."""
        from jobs.costs import BudgetStatus

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
    def record_attempt(cls, attempt_id: int) -> None:
        """Add a finished attempt to its job's cost and the day's roll-up (inside the finishing transaction)."""
        from jobs import tracking
        from jobs.costs import WASTED_LABELS

        attempt = Attempt.objects.select_related("job", "node").get(pk=attempt_id)
        job, c = attempt.job, attempt_cost_of(attempt)
        gpu_type = attempt.node.gpu_model
        keys = {"project_id": job.project_id, "user_id": job.submitted_by_id, "gpu_type": gpu_type}
        cls.objects.get_or_create(job_id=job.pk, defaults=keys)
        wasted = c.cost if c.label in WASTED_LABELS else 0
        cls.objects.filter(pk=job.pk).update(
            gpu_type=gpu_type,
            attempts=models.F("attempts") + 1,
            gpu_seconds=models.F("gpu_seconds") + c.gpu_seconds,
            preflight_cost=models.F("preflight_cost") + c.preflight_cost,
            running_cost=models.F("running_cost") + c.running_cost,
            cost=models.F("cost") + c.cost,
            wasted_cost=models.F("wasted_cost") + wasted,
        )
        day = (attempt.finished_at or timezone.now()).date()
        CostDaily.add(day=day, label=c.label, cost=c, **keys)
        transaction.on_commit(lambda: tracking.attempt_finished(job.pk))


def attempt_cost_of(attempt: "Attempt", now=None):
    """The cost of one attempt (so far, while it runs) at the rates of its node's GPU type."""
    from jobs.costs import attempt_cost

    return attempt_cost(
        len(attempt.gpu_indices) or attempt.job.gpus_per_node,
        attempt.started_at,
        attempt.running_at,
        attempt.finished_at,
        GpuRate.rates_for(attempt.node.gpu_model),
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
        row, _ = cls.objects.get_or_create(
            day=day, project_id=project_id, user_id=user_id, gpu_type=gpu_type, label=label
        )
        cls.objects.filter(pk=row.pk).update(
            attempts=models.F("attempts") + 1,
            gpu_seconds=models.F("gpu_seconds") + cost.gpu_seconds,
            preflight_cost=models.F("preflight_cost") + cost.preflight_cost,
            running_cost=models.F("running_cost") + cost.running_cost,
            cost=models.F("cost") + cost.cost,
        )
