"""Log lines as stored data: per-attempt sequence numbers, severity, the indexes searches use."""

from datetime import timedelta

from django.db import models
from django.db.models import Q
from django.utils import timezone

from jobs.models.attempt import Attempt
from jobs.models.job import Job


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
    across all ranks of the attempt (see jobs/logstore.py for how writers share it)."""

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
