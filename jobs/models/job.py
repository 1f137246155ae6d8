"""Jobs and their history.
The database row is the record of a job's state. Every state change is a
conditional update on the current state, so a transition applied twice (a
retried message, two schedulers, a late agent) takes effect once.
"""

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

from jobs.models.environment import Environment
from jobs.models.states import (
    ACTIVE_ATTEMPT_STATES,
    FINAL_JOB_STATES,
    STARTED_ATTEMPT_STATES,
    STATE_COLOURS,
    AttemptState,
    FailureClass,
    JobState,
)
from jobs.priority import Priority, PriorityClass, priority_class
from jobs.secret_env import SecretEnvField
from jobs.signals import job_ended
from portal import statements, wakeup
from portal.models import AuditEvent, Project

if TYPE_CHECKING:
    from jobs.models.attempt import Attempt


class Launcher(models.TextChoices):
    """How an attempt's ranks run the command."""

    COMMAND = "", "the command on every rank"
    RAY = "ray", "a Ray cluster; rank 0 runs the command as its driver"
    TORCHRUN = "torchrun", "torch.distributed.run: one process per GPU on every node"


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
    requirements = models.JSONField(
        default=list, blank=True, help_text="Python requirements of its cached environment (one specifier each)."
    )
    python_version = models.CharField(max_length=16, blank=True, help_text="e.g. 3.11; blank: the node's python3.")
    launcher = models.CharField(
        max_length=16,
        choices=Launcher.choices,
        default=Launcher.COMMAND,
        blank=True,
        help_text="ray: its nodes form a Ray cluster and rank 0 runs the command as the driver (agent/ray.py).",
    )
    requirements_key = models.CharField(
        max_length=64, blank=True, help_text="requirements_key() of what it asks for: the scheduler's cache affinity."
    )
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
    depends_on = models.JSONField(
        default=list,
        blank=True,
        help_text='[{"job": id, "on": "succeeded" | "finished"}]: it stays blocked until then.',
    )
    requeues = models.PositiveIntegerField(default=0, help_text="Times requeued after an infrastructure failure.")
    idempotency_key = models.CharField(max_length=200, blank=True, help_text="A retried submit returns this job.")
    secret_env = SecretEnvField(
        default=dict, blank=True, help_text="Given to the job, never shown back; values encrypted at rest."
    )
    volumes = models.JSONField(default=list, blank=True, help_text="[{name, path, mode, version}] as submitted.")
    # What reproduces the job, and its MLflow run (jobs/tracking.py).
    code_version = models.CharField(max_length=200, blank=True, help_text="e.g. a git commit.")
    # Its code snapshot (`hangar submit --code DIR`); `code` keeps the hash and the git facts
    # after retention removes an unreferenced snapshot (jobs/snapshots.py).
    snapshot = models.ForeignKey("jobs.Snapshot", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    code = models.JSONField(
        default=dict, blank=True, help_text="{snapshot: sha256, commit, branch, dirty, diff_truncated}."
    )
    code_diff = models.TextField(blank=True, help_text="`git diff HEAD` of a dirty work tree, size-capped.")
    config = models.JSONField(default=dict, blank=True)
    data_refs = models.JSONField(default=list, blank=True)
    mlflow_experiment_id = models.CharField(max_length=64, blank=True)
    mlflow_run_id = models.CharField(max_length=64, blank=True)
    tracking_error = models.TextField(blank=True, help_text="Why metrics are unavailable, when they are.")
    # The result contract (jobs/results.py): what the job is scored by, and metrics read from its log.
    objective = models.JSONField(
        default=dict, blank=True, help_text='{"metric": "val_loss", "mode": "min" | "max"}; empty: none.'
    )
    metrics_from_log = models.CharField(
        max_length=500, blank=True, help_text="An RE2 pattern with groups (?P<name>...) and (?P<value>...)."
    )
    submitted_with = models.ForeignKey(
        "portal.ApiToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs",
        help_text="The API token it was submitted with: its limits count the job.",
    )  # fmt: skip
    sweep = models.ForeignKey("jobs.Sweep", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    sweep_index = models.PositiveIntegerField(null=True, blank=True, help_text="Its variant's index in the sweep.")

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
        # A project's jobs in one state: its blocked jobs, read after every job that ends
        # (jobs/dependencies.py). With only `state` and `project` indexed, PostgreSQL read
        # every job of the project for it (1,208 rows, 0.43 ms, under bench/throughput.py).
        indexes = [models.Index(fields=["state", "project"], name="job_state_project")]

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
        """Kept across attempts, so a preempted or retried job can resume (on another host only
        where HANGAR_CHECKPOINT_ROOT is storage they share)."""
        if settings.HANGAR_CHECKPOINT_ROOT:
            return Path(settings.HANGAR_CHECKPOINT_ROOT) / str(self.pk)
        return settings.HANGAR_JOB_WORKDIR / str(self.pk) / "checkpoints"

    def latest_attempt(self) -> "Attempt | None":
        return self.attempts.order_by("-number").first()

    def cancel(self, by, reason: str = "") -> bool:
        """Cancel the job. A queued or not yet started job ends now; a started one
        is asked to stop and its agent ends it (SIGTERM, grace, SIGKILL)."""
        reason = reason or f"cancelled by {by}"
        with transaction.atomic():
            if self._end_while_waiting(reason):
                ended_here = done = True
            else:
                # An attempt not yet started ends now (attempt_finished tells of it); a started
                # one is only asked to stop: the job has not ended yet.
                ended_here, done = False, self._cancel_attempt(reason)
            if done:
                AuditEvent.record(by, "job.cancel", self, reason=reason)
                JobEvent.objects.create(job=self, kind="cancel", message=reason)
                if ended_here:
                    job_ended.send(sender=Job, job=self)  # a queued or blocked job ends here, with no attempt
                wakeup.request_pass()  # a waiting job may have held back smaller ones
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

    def _end_while_waiting(self, reason: str) -> bool:
        """End the job now if it is queued or blocked. In a savepoint, rolled back when it
        matched nothing: on PostgreSQL an UPDATE that waited for a row another transaction
        changed (the scheduler placing this job) and then found it no longer matching keeps
        that row locked. Held while the cancel went on to wait for the job's new attempt, that
        lock deadlocked with the agent starting the attempt (its row, then the job's): drill 8."""
        waiting = transaction.savepoint()
        ended = Job.objects.filter(pk=self.pk, state__in=[JobState.QUEUED, JobState.BLOCKED]).update(
            state=JobState.CANCELLED,
            finished_at=timezone.now(),
            failure_class=FailureClass.CANCELLED,
            state_reason=reason,
        )
        if ended:
            transaction.savepoint_commit(waiting)
        else:
            transaction.savepoint_rollback(waiting)  # and with it the lock
        return bool(ended)

    def _cancel_attempt(self, reason: str) -> bool:
        attempt = self.attempts.filter(state__in=ACTIVE_ATTEMPT_STATES).first()
        if attempt is None:
            return False
        if attempt.finish(AttemptState.CANCELLED, FailureClass.CANCELLED, reason, from_states=[AttemptState.SCHEDULED]):
            return True
        return bool(
            self.attempts.filter(pk=attempt.pk, state__in=STARTED_ATTEMPT_STATES, cancel_requested_at=None).update(
                cancel_requested_at=timezone.now(), reason=reason
            )
        )


class JobEvent(models.Model):
    """The history of a job: submitted, scheduled, started, ended, cancelled, requeued."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    attempt = models.ForeignKey("jobs.Attempt", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=32)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["at", "id"]

    COLUMNS = ("job_id", "attempt_id", "at", "kind", "message")

    @classmethod
    def insert_rows(cls, rows: list[tuple]) -> None:
        """Events as (job_id, attempt_id, at, kind, message) tuples, in one insert with no model
        instance for each (a submit's, a pass's placements', an attempt's end's)."""
        statements.insert(cls, cls.COLUMNS, rows)
