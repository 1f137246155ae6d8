"""Attempts: one try of a job on a concrete placement, with its lease and its end."""

import functools
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import models, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from jobs.models.job import Job, JobEvent
from jobs.models.states import (
    ACTIVE_ATTEMPT_STATES,
    FINAL_JOB_STATES,
    STARTED_ATTEMPT_STATES,
    STATE_COLOURS,
    AttemptState,
    FailureClass,
    JobState,
)
from jobs.signals import attempt_finished
from portal import statements, wakeup


@dataclass(frozen=True)
class JobMoved:
    """The job as the transaction that ended one of its attempts left it: what the receivers
    of attempt_finished need (its dependents, its sweep, its pipeline run), read
    once under the job's lock instead of once by each of them."""

    pk: int
    state: str
    project_id: int
    submitted_by_id: int
    sweep_id: int | None
    gpus: int
    staged: bool  # it runs a stage of a pipeline run (a reused stage runs nothing)

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_JOB_STATES


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
    priced_at = models.DateTimeField(
        null=True, blank=True, help_text="Its cost was added to its job's and the day's (jobs/settling.py)."
    )
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
    environment = models.JSONField(
        default=dict, blank=True, help_text="Its cached environment on rank 0's node: hash, python, packages, cached."
    )
    tracking_digests = models.JSONField(
        default=list, blank=True, help_text="SHA-256 of each rank's MLflow credential (jobs/tracking.py)."
    )

    class Meta:
        # By the job's id, not "job": ordering through the relation would join the job's table
        # (for its own ordering) into every unordered query of attempts, and lock the job's
        # row too in a select_for_update (an agent's start, each log batch's fence).
        ordering = ["job_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="attempt_number_unique"),
            # The database itself refuses a second live attempt of one job.
            models.UniqueConstraint(
                fields=["job"], condition=Q(state__in=["scheduled", "preflight", "running"]), name="one_live_attempt"
            ),
        ]
        indexes = [
            models.Index(fields=["state", "node"]),
            # The ended attempts not settled yet (jobs/settling.py): a few, each for about a second.
            models.Index(
                fields=["finished_at"], name="attempt_unsettled", condition=Q(priced_at=None, finished_at__isnull=False)
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of job {self.job_id}"

    @property
    def state_colour(self) -> str:
        return STATE_COLOURS[self.state]

    @property
    def ranks(self) -> list[dict]:
        """Every rank's node and GPUs (a one-node attempt of old has no placement stored)."""
        return ranks_of(self.placement, self.node_id, self.gpu_indices)

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
            # The first rank taken (every one-node attempt's only one): one conditional write. No
            # rank of a scheduled attempt has been taken, so its rank_status is this rank's alone.
            if first_rank_taken(rank).update(pk=self.pk, now=now, lease_expires_at=lease_from(now)):
                self.rank_status = {str(rank): None}
                job_state_moved.update(pk=self.job_id, state=JobState.SCHEDULED, new_state=JobState.PREFLIGHT)
                return True
            # Another rank of it was taken first (or it ended): read it under its lock.
            row = (
                Attempt.objects.select_for_update(no_key=True).filter(pk=self.pk).values("state", "rank_status").first()
            )
            if row is None or row["state"] not in ACTIVE_ATTEMPT_STATES or str(rank) in row["rank_status"]:
                return False
            self.rank_status = {**row["rank_status"], str(rank): None}
            update = {"rank_status": self.rank_status, "lease_expires_at": lease_from(now)}
            if row["state"] == AttemptState.SCHEDULED:
                update.update(state=AttemptState.PREFLIGHT, started_at=now)
                job_state_moved.update(pk=self.job_id, state=JobState.SCHEDULED, new_state=JobState.PREFLIGHT)
            Attempt.objects.filter(pk=self.pk).update(**update)
        return True

    def mark_running(self, pid: int, environment: dict | None = None) -> bool:
        """A rank's command started. The first one moves the attempt (and job) to running.
        `environment`: the cached environment it runs in (rank 0's), recorded in the same write."""
        now = timezone.now()
        with transaction.atomic():
            ok = command_started.update(pk=self.pk, now=now, pid=pid, lease_expires_at=lease_from(now))
            if ok:
                job_state_moved.update(pk=self.job_id, state=JobState.PREFLIGHT, new_state=JobState.RUNNING)
            if environment:  # in the same transaction as the start it belongs to
                ok = Attempt.objects.filter(pk=self.pk, state=AttemptState.RUNNING).update(environment=environment)
            elif not ok:
                ok = Attempt.objects.filter(pk=self.pk, state=AttemptState.RUNNING).exists()
        return bool(ok)

    def add_tracking_digest(self, digest: str) -> bool:
        """Record the digest of an MLflow credential handed to one of its ranks, under the row's
        lock: every rank of a multi-node attempt adds its own. False once the attempt has ended."""
        with transaction.atomic():
            row = (
                Attempt.objects.select_for_update(no_key=True)
                .filter(pk=self.pk, state__in=ACTIVE_ATTEMPT_STATES)
                .values("tracking_digests")
                .first()
            )
            if row is None:
                return False
            self.tracking_digests = [*row["tracking_digests"], digest]
            Attempt.objects.filter(pk=self.pk).update(tracking_digests=self.tracking_digests)
        return True

    def rank_exited(self, rank: int, code: int, at: float, stopped: bool) -> bool:
        """Record how one rank's process ended, for the diagnosis (which rank failed first: the
        order of exits, not of stored lines); True when every rank's end is recorded."""
        with transaction.atomic():
            row = Attempt.objects.select_for_update(no_key=True).filter(pk=self.pk).values("rank_status").first()
            if row is None:
                return False
            self.rank_status = {**row["rank_status"], str(rank): {"exit": code, "at": at, "stopped": stopped}}
            Attempt.objects.filter(pk=self.pk).update(rank_status=self.rank_status)
        return all(self.rank_status.get(str(r["rank"])) is not None for r in self.ranks)

    def rank_succeeded(self, rank: int) -> bool:
        """Record that one rank exited 0; True when every rank has, so the attempt succeeded."""
        with transaction.atomic():
            row = Attempt.objects.select_for_update(no_key=True).filter(pk=self.pk).values("rank_status").first()
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
            ends = attempt_ended(tuple(from_states))
            ended = ends.update(
                pk=self.pk, state=state, failure_class=failure_class, reason=reason, exit_code=exit_code, now=now
            )
            if not ended:
                return False
            self.state, self.failure_class, self.reason, self.exit_code = state, failure_class, reason, exit_code
            self.finished_at, self.lease_expires_at = now, None
            job = self._move_job_on(now)
            # First, so the wake-up is the first thing after the commit: the receivers' own
            # after-commit work (its dependents, a diagnosis) must not delay the hand-off of its
            # GPUs to the next job.
            # Its GPUs are free; the queue changed only if the job was queued again.
            wakeup.request_pass(queue_changed=job.state == JobState.QUEUED)
            # Its dependents, sweep and pipeline run; its cost and MLflow run come a moment later,
            # from the notifier (jobs/settling.py).
            attempt_finished.send(sender=Attempt, attempt=self, job=job)
        return True

    def _move_job_on(self, now) -> JobMoved:
        """Move the job on from this attempt's end (unless it is over already): one read of it,
        locked, with whether a cancel was asked of this attempt meanwhile."""
        row = job_to_move_on.first(pk=self.job_id, attempt_id=self.pk)
        if row is None:
            raise Job.DoesNotExist(f"job {self.job_id} of attempt {self.pk}")
        moved = {
            "pk": self.job_id,
            "project_id": row["project_id"],
            "submitted_by_id": row["submitted_by_id"],
            "sweep_id": row["sweep_id"],
            "gpus": row["gpus_per_node"] * row["nodes"],
            "staged": row["staged"],
        }
        if row["state"] in FINAL_JOB_STATES:
            return JobMoved(state=row["state"], **moved)
        if self.state == AttemptState.CANCELLED or row["cancel_asked"]:
            kind, update = JobState.CANCELLED, {"state": JobState.CANCELLED, "failure_class": FailureClass.CANCELLED}
        elif self.state == AttemptState.SUCCEEDED:
            kind, update = JobState.SUCCEEDED, {"state": JobState.SUCCEEDED, "failure_class": ""}
        elif requeue := requeue_for(self.failure_class, row):
            kind, update = requeue
            update.update(state=JobState.QUEUED, queued_at=now)
        else:
            kind, update = JobState.FAILED, {"state": JobState.FAILED, "failure_class": self.failure_class}
        if update["state"] == JobState.QUEUED:
            Job.objects.filter(pk=self.job_id).update(**update, state_reason=self.reason)
        else:
            job_over.update(pk=self.job_id, **update, now=now, exit_code=self.exit_code, reason=self.reason)
        JobEvent.insert_rows([(self.job_id, self.pk, now, kind, self.reason)])
        return JobMoved(state=update["state"], **moved)

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


@functools.cache
def attempt_ended(from_states: tuple[str, ...]) -> statements.Statement:
    """The end of an attempt still in one of these states (one statement for each such set)."""

    @statements.update
    def ended(pk: int, state: str, failure_class: str, reason: str, exit_code: int | None, now: datetime):
        return Attempt.objects.filter(pk=pk, state__in=from_states), {
            "state": state,
            "failure_class": failure_class,
            "reason": reason,
            "exit_code": exit_code,
            "finished_at": now,
            "lease_expires_at": None,
        }

    return ended


@functools.cache
def first_rank_taken(rank: int) -> statements.Statement:
    """A scheduled attempt taken by its first rank, this one (one statement for each rank
    number: its rank_status is a constant of it)."""

    @statements.update
    def taken(pk: int, now: datetime, lease_expires_at: datetime):
        return Attempt.objects.filter(pk=pk, state=AttemptState.SCHEDULED), {
            "state": AttemptState.PREFLIGHT,
            "rank_status": {str(rank): None},
            "lease_expires_at": lease_expires_at,
            "started_at": now,
        }

    return taken


@statements.update
def job_state_moved(pk: int, state: str, new_state: str):
    """A job moved on from one state only: the move of a job that left it meanwhile matches nothing."""
    return Job.objects.filter(pk=pk, state=state), {"state": new_state}


@statements.update
def job_over(pk: int, state: str, failure_class: str, now: datetime, exit_code: int | None, reason: str):
    """A job's end, from its attempt's (Attempt._move_job_on: the job is locked)."""
    return Job.objects.filter(pk=pk), {
        "state": state,
        "failure_class": failure_class,
        "finished_at": now,
        "exit_code": exit_code,
        "state_reason": reason,
    }


@statements.update
def command_started(pk: int, now: datetime, pid: int, lease_expires_at: datetime):
    """The first rank's command started: the attempt runs (once)."""
    return Attempt.objects.filter(pk=pk, state=AttemptState.PREFLIGHT), {
        "state": AttemptState.RUNNING,
        "running_at": now,
        "pid": pid,
        "lease_expires_at": lease_expires_at,
    }


@statements.query
def job_to_move_on(pk: int, attempt_id: int):
    """The job an attempt of it ended, locked, with what moving it on reads (Attempt._move_job_on)."""
    from jobs.models.pipeline import PipelineStage

    return (
        Job.objects.select_for_update(no_key=True)
        .filter(pk=pk)
        .values(
            *("state", "retries", "max_retries", "requeues", "preemptions", "gpus_per_node", "nodes"),
            *("project_id", "submitted_by_id", "sweep_id"),
            # Read again: a cancel may have been asked after the attempt was loaded.
            cancel_asked=Exists(Attempt.objects.filter(pk=attempt_id, cancel_requested_at__isnull=False)),
            staged=Exists(PipelineStage.objects.filter(job_id=OuterRef("pk"), reused=False)),
        )[:1]
    )


def ranks_of(placement: list[dict], node_id: int, gpu_indices: list[int]) -> list[dict]:
    """An attempt's ranks from its stored columns: its placement, or rank 0 alone."""
    return placement or [{"rank": 0, "node_id": node_id, "node": None, "gpus": gpu_indices}]


def requeue_for(failure_class: str, counts: dict) -> tuple[str, dict] | None:
    """Whether a job whose attempt ended this way goes back to the queue: the event
    kind and the counter it uses. Only the command's own failures use the job's
    retry budget; infrastructure losses and preemptions have caps against loops.
    `counts`: the job's retries, max_retries, requeues and preemptions."""
    if failure_class == FailureClass.USER and counts["retries"] < counts["max_retries"]:
        return "retry", {"retries": counts["retries"] + 1}
    if failure_class == FailureClass.INFRA and counts["requeues"] < settings.HANGAR_MAX_REQUEUES:
        return "requeue", {"requeues": counts["requeues"] + 1}
    if failure_class == FailureClass.PREEMPTED and counts["preemptions"] < settings.HANGAR_MAX_PREEMPTIONS:
        return "preempted", {"preemptions": counts["preemptions"] + 1}
    return None


def lease_from(now):
    return now + timedelta(seconds=settings.HANGAR_LEASE_SECONDS)
