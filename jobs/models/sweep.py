"""Sweeps: variants of one job spec with an objective, submitted as `max_parallel` allows
(jobs/sweeps.py decides and submits; this is the record)."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from jobs.models.job import Job
from jobs.models.states import FINAL_JOB_STATES
from portal.models import ApiToken, Project


class SweepQuerySet(models.QuerySet):
    def visible_to(self, user) -> "SweepQuerySet":
        return self.filter(project__in=Project.objects.visible_to(user))


class Sweep(models.Model):
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="sweeps")
    submitted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="sweeps")
    submitted_with = models.ForeignKey(ApiToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    name = models.CharField(max_length=200)
    key = models.CharField(max_length=200, help_text="Its idempotency key: the same sweep file again returns it.")
    content = models.CharField(max_length=80, blank=True, help_text="A hash of the file it was made from.")
    base = models.JSONField(help_text="The base job spec every variant starts from.")
    params = models.JSONField(help_text="Each variant's overrides of the base, in order (index = position).")
    max_parallel = models.PositiveIntegerField()
    objective = models.JSONField(help_text='{"metric": ..., "mode": "min" | "max"}: what ranks its runs.')
    refused = models.JSONField(default=dict, blank=True, help_text="By index: why that variant was not submitted.")
    waiting_reason = models.TextField(blank=True, help_text="Why the next variants wait (a token limit, say).")
    created_at = models.DateTimeField(default=timezone.now)

    objects = SweepQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [models.UniqueConstraint(fields=["submitted_by", "key"], name="sweep_key_per_user")]

    def __str__(self) -> str:
        return f"sweep {self.pk} {self.name}"

    @property
    def size(self) -> int:
        return len(self.params)

    def unfinished(self) -> models.QuerySet:
        return Job.objects.filter(sweep=self).exclude(state__in=FINAL_JOB_STATES)

    def pending(self) -> list[int]:
        """Indexes with no job yet and not refused, in order."""
        made = set(Job.objects.filter(sweep=self).values_list("sweep_index", flat=True))
        return [i for i in range(self.size) if i not in made and str(i) not in self.refused]
