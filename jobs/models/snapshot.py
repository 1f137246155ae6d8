"""Code snapshots: the content-addressed tarball of the directory a job was submitted from
(`hangar submit --code DIR`), kept per project.

The tarball is stored in the database, in chunks: an agent on another host reaches the
portal only through the database and the broker (it has no API token), so what it must
fetch has to be there. Each agent keeps an unpacked copy per hash (agent/snapshots.py).
"""

from datetime import timedelta

from django.conf import settings
from django.db import models
from django.utils import timezone

from jobs.models.states import FINAL_JOB_STATES, JobState
from portal.models import Project


class SnapshotQuerySet(models.QuerySet):
    def visible_to(self, user) -> "SnapshotQuerySet":
        return self.filter(project__in=Project.objects.visible_to(user))


class Snapshot(models.Model):
    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="snapshots")
    sha256 = models.CharField(max_length=64, help_text="Of the tar.gz as uploaded (and stored).")
    size = models.PositiveBigIntegerField(help_text="Bytes of the tar.gz.")
    unpacked_size = models.PositiveBigIntegerField(help_text="Bytes of its files.")
    files = models.PositiveIntegerField()
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)
    last_referenced_at = models.DateTimeField(
        default=timezone.now, db_index=True, help_text="Uploaded, or last named by a submitted job."
    )

    objects = SnapshotQuerySet.as_manager()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["project", "sha256"], name="snapshot_sha256_per_project")]

    def __str__(self) -> str:
        return f"snapshot {self.sha256[:12]} of {self.project_id}"

    def touch(self) -> None:
        """A job names it: retention counts from now."""
        now = timezone.now()
        Snapshot.objects.filter(pk=self.pk).update(last_referenced_at=now)
        self.last_referenced_at = now

    def chunks(self):
        """The tar.gz, piece by piece (one row in memory at a time)."""
        for index in self.chunk_rows.order_by("index").values_list("index", flat=True):
            yield bytes(self.chunk_rows.filter(index=index).values_list("data", flat=True).get())

    @classmethod
    def delete_expired(cls, days: float, max_rows: int = 100) -> int:
        """Delete snapshots no job has named for `days`, except those of jobs not yet ended
        (a queued job still needs its code). The jobs that named one keep its hash."""
        cutoff = timezone.now() - timedelta(days=days)
        waiting = [state for state in JobState.values if state not in FINAL_JOB_STATES]
        expired = cls.objects.filter(last_referenced_at__lt=cutoff).exclude(jobs__state__in=waiting)
        ids = list(expired.order_by("last_referenced_at").values_list("pk", flat=True)[:max_rows])
        deleted = 0
        for pk in ids:  # one at a time, asked again: a submit may have named it meanwhile
            deleted += expired.filter(pk=pk).delete()[1].get("jobs.Snapshot", 0)
        return deleted


class SnapshotChunk(models.Model):
    snapshot = models.ForeignKey(Snapshot, on_delete=models.CASCADE, related_name="chunk_rows")
    index = models.PositiveIntegerField()
    data = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["snapshot", "index"], name="snapshot_chunk_index")]
