"""Jobs, their attempts, their log lines and their history.

The database row is the record of a job's state. Every state change is a
conditional update on the current state, so a transition applied twice (a
retried message, two schedulers, a late agent) takes effect once.
"""

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from jobs.secret_env import SecretEnvField
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
    PREEMPTED = "preempted", "Preempted"
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
    "preempted": "orange",
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
    """The built-in priority classes; HANGAR_PRIORITY_CLASSES may define others."""

    URGENT = "urgent", "Urgent"
    HIGH = "high", "High"
    NORMAL = "normal", "Normal"
    LOW = "low", "Low"
    SCAVENGER = "scavenger", "Scavenger"

    @property
    def rank(self) -> int:
        """Higher goes first."""
        return priority_class(self.value).rank


@dataclass(frozen=True)
class PriorityClass:
    name: str
    rank: int
    may_preempt: bool = False
    preemptible: bool = False


def priority_classes() -> dict[str, PriorityClass]:
    """The configured classes (HANGAR_PRIORITY_CLASSES), highest rank first."""
    configured = settings.HANGAR_PRIORITY_CLASSES
    ordered = sorted(configured.items(), key=lambda item: -item[1]["rank"])
    return {name: PriorityClass(name, **fields) for name, fields in ordered}


def priority_class(name: str) -> PriorityClass:
    """A class by name; a name no longer configured ranks lowest and is preemptible."""
    return priority_classes().get(name) or PriorityClass(name, rank=-1, preemptible=True)


class EnvironmentKind(models.TextChoices):
    HOST = "host", "Host interpreter or virtualenv"
    CONTAINER = "container", "Container image (docker run --gpus)"


class Environment(models.Model):
    """Where a job's command runs: a host interpreter/virtualenv, or a container image.

    A node advertises the environments it can run (`manage.py agent --environments`);
    one marked `everywhere` runs on every node.
    """

    name = models.SlugField(max_length=64, unique=True)
    description = models.CharField(max_length=200, blank=True)
    kind = models.CharField(max_length=16, choices=EnvironmentKind.choices, default=EnvironmentKind.HOST)
    path = models.CharField(
        max_length=500, blank=True, help_text="Host kind: a virtualenv or prefix; its bin/ goes first on PATH."
    )
    image = models.CharField(max_length=300, blank=True, help_text="Container kind: the image to run.")
    everywhere = models.BooleanField(default=False, help_text="Every node can run it.")
    nodes = models.ManyToManyField("fleet.Node", blank=True, related_name="environments")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def advertise(cls, node, names: list[str]) -> list[str]:
        """Set the environments a node can run (besides those that run everywhere);
        returns the names that are not defined, which are ignored."""
        known = {e.name: e for e in cls.objects.filter(name__in=names)}
        with transaction.atomic():
            for environment in cls.objects.filter(nodes=node).exclude(name__in=list(known)):
                environment.nodes.remove(node)
            for environment in known.values():
                environment.nodes.add(node)
        from jobs.scheduler import request_pass

        request_pass()  # what the node can run changed, and it may be new: place work now
        return sorted(set(names) - set(known))


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
    priority = models.CharField(max_length=32, default=Priority.NORMAL, help_text="A class of HANGAR_PRIORITY_CLASSES.")
    preemptible = models.BooleanField(
        null=True, blank=True, help_text="Blank: as its priority class says. True makes any class preemptible."
    )
    environment = models.ForeignKey(Environment, null=True, blank=True, on_delete=models.PROTECT, related_name="jobs")
    max_runtime_seconds = models.PositiveIntegerField()
    max_retries = models.PositiveSmallIntegerField(default=0, help_text="Retries after the command itself failed.")
    stop_on_hang = models.BooleanField(default=False, help_text="End an attempt whose hang is suspected.")
    retries = models.PositiveSmallIntegerField(default=0, help_text="Retries used (failure class user).")
    preemptions = models.PositiveIntegerField(default=0, help_text="Times preempted and requeued.")
    order_at = models.DateTimeField(default=timezone.now, help_text="Place within its priority class in the queue.")
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED, db_index=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    queued_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    failure_class = models.CharField(max_length=16, choices=FailureClass.choices, blank=True)
    state_reason = models.TextField(blank=True)
    requeues = models.PositiveIntegerField(default=0, help_text="Times requeued after an infrastructure failure.")
    idempotency_key = models.CharField(max_length=200, blank=True, help_text="A retried submit returns this job.")
    secret_env = SecretEnvField(
        default=dict, blank=True, help_text="Given to the job, never shown back; values encrypted at rest."
    )
    volumes = models.JSONField(default=list, blank=True, help_text="[{name, path, mode, version}] as submitted.")
    # What reproduces the job, and its MLflow run (jobs/tracking.py).
    code_version = models.CharField(max_length=200, blank=True, help_text="e.g. a git commit.")
    config = models.JSONField(default=dict, blank=True)
    data_refs = models.JSONField(default=list, blank=True)
    mlflow_experiment_id = models.CharField(max_length=64, blank=True)
    mlflow_run_id = models.CharField(max_length=64, blank=True)
    tracking_error = models.TextField(blank=True, help_text="Why metrics are unavailable, when they are.")

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["submitted_by", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="job_idempotency_key_per_user",
            )
        ]

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

    @property
    def priority_class(self) -> PriorityClass:
        return priority_class(self.priority)

    @property
    def is_preemptible(self) -> bool:
        return bool(self.preemptible) or self.priority_class.preemptible

    def checkpoint_dir(self):
        """Kept across attempts, so a preempted or retried job can resume."""
        return settings.HANGAR_JOB_WORKDIR / str(self.pk) / "checkpoints"

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
                from jobs.scheduler import request_pass

                request_pass()  # a waiting job may have held back smaller ones
        self.refresh_from_db()
        return done

    def move(self, by, direction: str, movable: "JobQuerySet") -> bool:
        """Swap places in the queue with the nearest queued job of the same class, above
        ("up") or below ("down"), among `movable` (the jobs `by` may reorder)."""
        with transaction.atomic():
            me = Job.objects.select_for_update().filter(pk=self.pk, state=JobState.QUEUED).first()
            if me is None:
                return False
            same = movable.select_for_update().filter(state=JobState.QUEUED, priority=me.priority).exclude(pk=me.pk)
            if direction == "up":
                near = same.filter(Q(order_at__lt=me.order_at) | Q(order_at=me.order_at, pk__lt=me.pk))
                other = near.order_by("-order_at", "-pk").first()
            else:
                near = same.filter(Q(order_at__gt=me.order_at) | Q(order_at=me.order_at, pk__gt=me.pk))
                other = near.order_by("order_at", "pk").first()
            if other is None:
                return False
            mine, theirs = other.order_at, me.order_at
            if mine == theirs:  # equal times order by id: step past the other one
                mine = mine + timedelta(microseconds=-1 if direction == "up" else 1)
            Job.objects.filter(pk=me.pk).update(order_at=mine)
            Job.objects.filter(pk=other.pk).update(order_at=theirs)
            JobEvent.objects.create(job=self, kind="moved", message=f"{direction} past job {other.pk} by {by}")
        self.refresh_from_db()
        return True

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
    """One try of a job on a concrete placement: one rank per node, each with its GPU indices.

    `node` and `gpu_indices` are rank 0's; `placement` lists every rank's.
    """

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
    placement = models.JSONField(default=list, blank=True, help_text='[{"rank", "node_id", "node", "gpus"}], by rank.')
    borrowed = models.BooleanField(default=False, help_text="Placed on GPUs beyond its project's quota.")
    preempt_requested_at = models.DateTimeField(null=True, blank=True)
    rank_status = models.JSONField(default=dict, blank=True, help_text="By rank: its exit code once it ended.")
    diagnosis = models.JSONField(default=dict, blank=True, help_text="Why it failed (jobs/diagnosis.py); hang flags.")

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
    def ranks(self) -> list[dict]:
        """Every rank's node and GPUs (a one-node attempt of old has no placement stored)."""
        if self.placement:
            return self.placement
        return [{"rank": 0, "node_id": self.node_id, "node": None, "gpus": self.gpu_indices}]

    def preflight_seconds(self) -> float | None:
        if self.started_at is None:
            return None
        end = self.running_at or self.finished_at or timezone.now()
        return (end - self.started_at).total_seconds()

    def running_seconds(self) -> float | None:
        if self.running_at is None:
            return None
        return ((self.finished_at or timezone.now()) - self.running_at).total_seconds()

    def begin(self, rank: int = 0) -> bool:
        """An agent takes one rank; the first rank taken moves the attempt scheduled -> preflight.
        False if that rank was taken already or the attempt is no longer current."""
        now = timezone.now()
        with transaction.atomic():
            row = Attempt.objects.select_for_update().filter(pk=self.pk).values("state", "rank_status").first()
            if row is None or row["state"] not in ACTIVE_ATTEMPT_STATES or str(rank) in row["rank_status"]:
                return False
            self.rank_status = {**row["rank_status"], str(rank): None}
            update = {"rank_status": self.rank_status, "lease_expires_at": lease_from(now)}
            if row["state"] == AttemptState.SCHEDULED:
                update.update(state=AttemptState.PREFLIGHT, started_at=now)
                Job.objects.filter(pk=self.job_id, state=JobState.SCHEDULED).update(state=JobState.PREFLIGHT)
            Attempt.objects.filter(pk=self.pk).update(**update)
        return True

    def mark_running(self, pid: int) -> bool:
        """A rank's command started. The first one moves the attempt (and job) to running."""
        now = timezone.now()
        with transaction.atomic():
            ok = Attempt.objects.filter(pk=self.pk, state=AttemptState.PREFLIGHT).update(
                state=AttemptState.RUNNING, running_at=now, pid=pid, lease_expires_at=lease_from(now)
            )
            if ok:
                Job.objects.filter(pk=self.job_id, state=JobState.PREFLIGHT).update(state=JobState.RUNNING)
            else:
                ok = Attempt.objects.filter(pk=self.pk, state=AttemptState.RUNNING).exists()
        return bool(ok)

    def rank_succeeded(self, rank: int) -> bool:
        """Record that one rank exited 0; True when every rank has, so the attempt succeeded."""
        with transaction.atomic():
            row = Attempt.objects.select_for_update().filter(pk=self.pk).values("rank_status").first()
            if row is None:
                return False
            self.rank_status = {**row["rank_status"], str(rank): 0}
            Attempt.objects.filter(pk=self.pk).update(rank_status=self.rank_status)
        return all(self.rank_status.get(str(r["rank"])) == 0 for r in self.ranks)

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
            if state != AttemptState.SUCCEEDED:  # why it failed, once its end is committed
                from jobs.diagnosing import diagnose_after_commit

                diagnose_after_commit(self.pk)
            from jobs.scheduler import request_pass

            request_pass()  # its GPUs are free, and the job may be queued again
        return True

    def _move_job_on(self, now) -> None:
        job = Job.objects.select_for_update().get(pk=self.job_id)
        if job.is_final:
            return
        if self.state == AttemptState.CANCELLED or self._cancel_was_requested():
            kind, update = JobState.CANCELLED, {"state": JobState.CANCELLED, "failure_class": FailureClass.CANCELLED}
        elif self.state == AttemptState.SUCCEEDED:
            kind, update = JobState.SUCCEEDED, {"state": JobState.SUCCEEDED, "failure_class": ""}
        elif requeue := requeue_for(self.failure_class, job):
            kind, update = requeue
            update.update(state=JobState.QUEUED, queued_at=now)
        else:
            kind, update = JobState.FAILED, {"state": JobState.FAILED, "failure_class": self.failure_class}
        if update["state"] != JobState.QUEUED:
            update.update(finished_at=now, exit_code=self.exit_code)
        update["state_reason"] = self.reason
        Job.objects.filter(pk=job.pk).update(**update)
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
        ended = [
            a
            for a in stale
            if a.finish(AttemptState.LOST, FailureClass.INFRA, reason, from_states=[AttemptState.SCHEDULED])
        ]
        # A gang whose other ranks started but one never did would wait for it until its max runtime.
        rows = cls.objects.filter(state__in=STARTED_ATTEMPT_STATES, started_at__lt=cutoff).values_list(
            "pk", "rank_status", "placement"
        )
        partial = cls.objects.filter(pk__in=[pk for pk, status, ranks in rows if len(status) < len(ranks)])
        missing = f"a rank was not started by its node's agent within {settings.HANGAR_START_TIMEOUT_SECONDS:.0f}s"
        return ended + [a for a in partial if a.finish(AttemptState.LOST, FailureClass.INFRA, missing)]


def requeue_for(failure_class: str, job: Job) -> tuple[str, dict] | None:
    """Whether a job whose attempt ended this way goes back to the queue: the event
    kind and the counter it uses. Only the command's own failures use the job's
    retry budget; infrastructure losses and preemptions have caps against loops."""
    if failure_class == FailureClass.USER and job.retries < job.max_retries:
        return "retry", {"retries": job.retries + 1}
    if failure_class == FailureClass.INFRA and job.requeues < settings.HANGAR_MAX_REQUEUES:
        return "requeue", {"requeues": job.requeues + 1}
    if failure_class == FailureClass.PREEMPTED and job.preemptions < settings.HANGAR_MAX_PREEMPTIONS:
        return "preempted", {"preemptions": job.preemptions + 1}
    return None


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
    """One line of a job's output. `seq` counts from 1 within its attempt, with no gaps,
    across all ranks of the attempt (see jobs/logingest.py for how writers share it)."""

    # job and attempt are indexed by log_cursor_unique and log_rank_seq_unique; an index
    # of their own would only slow ingest down (each index costs the insert ~1 us a row).
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_lines", db_index=False)
    attempt = models.ForeignKey(Attempt, on_delete=models.CASCADE, related_name="log_lines", db_index=False)
    node = models.ForeignKey("fleet.Node", null=True, on_delete=models.SET_NULL, related_name="+")
    rank = models.PositiveSmallIntegerField(default=0)
    seq = models.PositiveIntegerField()
    # The line's number in its rank's output, given by the agent's writer: a batch sent
    # twice (its commit was never acknowledged) is recognised by it and stored once.
    rank_seq = models.PositiveIntegerField(default=0)
    stream = models.PositiveSmallIntegerField(choices=Stream.choices)
    severity = models.PositiveSmallIntegerField(choices=Severity.choices, default=Severity.INFO)
    fault = models.BooleanField(default=False, help_text="Matches an NCCL/Xid/CUDA/ECC fault pattern.")
    ts = models.DateTimeField()
    text = models.TextField()

    class Meta:
        ordering = ["attempt_id", "seq"]
        constraints = [
            # Cursor paging of a job's lines (the other filters narrow within a job); unique
            # because an attempt belongs to one job, so it also keeps seq unique per attempt.
            models.UniqueConstraint(fields=["job", "attempt", "seq"], name="log_cursor_unique"),
            models.UniqueConstraint(fields=["attempt", "rank", "rank_seq"], name="log_rank_seq_unique"),
        ]
        indexes = [
            # Severity with rank: errors of one rank come from the index, not the heap.
            models.Index(fields=["job", "severity", "rank"], name="log_job_severity_rank"),
            # Finding an attempt's first error: only errors and faults are in it.
            models.Index(
                fields=["job", "attempt", "seq"],
                condition=Q(severity__gte=40) | Q(fault=True),
                name="log_job_errors",
            ),
            models.Index(fields=["job", "node", "rank"], name="log_job_node"),
            models.Index(fields=["job", "ts"], name="log_job_ts"),
            # Retention deletes by age across all jobs.
            models.Index(fields=["ts"], name="log_ts"),
            # On PostgreSQL also log_text_lower_trgm, a trigram index on lower(text)
            # for text search (migration 0008).
        ]

    @classmethod
    def after(cls, job_id: int, attempt_id: int, seq: int) -> models.QuerySet:
        """Lines of a job after a cursor (attempt id, seq), in order."""
        return (
            cls.objects.filter(job_id=job_id)
            .filter(Q(attempt_id__gt=attempt_id) | Q(attempt_id=attempt_id, seq__gt=seq))
            .order_by("attempt_id", "seq")
        )

    @classmethod
    def high_water(cls, job_id: int, attempt_id: int | None = None) -> tuple[int, int]:
        """The cursor of the job's last stored line (of one attempt's, given `attempt_id`),
        (0, 0) when none.

        Writers commit an attempt's lines in seq order and a job has one live
        attempt, so every line at or before this cursor is already visible.
        """
        lines = cls.objects.filter(job_id=job_id)
        if attempt_id is not None:
            lines = lines.filter(attempt_id=attempt_id)
        last = lines.order_by("-attempt_id", "-seq").values_list("attempt_id", "seq")
        return last.first() or (0, 0)

    @classmethod
    def delete_expired(cls, days: float, batch: int = 10_000, max_batches: int = 100) -> int:
        """Delete lines older than `days` in bounded batches, so no pass holds long locks."""
        cutoff = timezone.now() - timedelta(days=days)
        deleted = 0
        for _ in range(max_batches):
            ids = list(cls.objects.filter(ts__lt=cutoff).order_by("ts").values_list("pk", flat=True)[:batch])
            if not ids:
                break
            deleted += cls.objects.filter(pk__in=ids).delete()[0]
        return deleted


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
    def applying(cls, day) -> models.QuerySet:
        """Budgets that apply in the month of `day`: that month's own, and every-month ones."""
        return cls.objects.filter(Q(month=day.replace(day=1)) | Q(month=None))

    @classmethod
    def for_month(cls, project_id: int, day) -> "Budget | None":
        budgets = cls.applying(day).filter(project_id=project_id)
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


def attempt_cost_of(attempt: "Attempt", now=None, rates: list | None = None):
    """The cost of one attempt (so far, while it runs) at the rates of its node's GPU type
    (`rates`, when the caller has loaded them already)."""
    from jobs.costs import attempt_cost

    return attempt_cost(
        sum(len(rank["gpus"]) for rank in attempt.ranks) or attempt.job.gpus,  # every rank's GPUs
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
