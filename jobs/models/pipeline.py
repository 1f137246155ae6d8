"""Pipeline runs and their stages (jobs/pipelines.py plans, submits, cancels and reruns them).

A stage is an ordinary job, made by `submit_job` with `depends_on` on the jobs of the stages
it needs; the run only names them and holds what they share: parameters, one directory and
a parent MLflow run. Its state is read from its stages' jobs, never stored twice.

A rerun from a stage starts its directory as a copy of the earlier run's, made on the node by
the first stage's attempt before its command, as that stage's uid (agent/pipelinecopy.py); the
run row only shows how far that copy got (`copy_*`). `PipelineUid` records every uid a stage
of the run ran as: root shares files in the run's directory only when one of them owns them.
"""

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from jobs.models.job import Job
from jobs.models.states import FINAL_JOB_STATES, JobState
from portal.models import Project


class PipelineState(models.TextChoices):
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


def pipeline_state(job_states: list[str]) -> str:
    """Running while any stage's job is not over; then failed if one failed, succeeded if all did."""
    if any(state not in FINAL_JOB_STATES for state in job_states):
        return PipelineState.RUNNING
    if any(state == JobState.FAILED for state in job_states):
        return PipelineState.FAILED
    if all(state == JobState.SUCCEEDED for state in job_states):
        return PipelineState.SUCCEEDED
    return PipelineState.CANCELLED


class CopyState(models.TextChoices):
    """How far a rerun's copy of the earlier run's directory got (blank: the run copies nothing)."""

    WAITING = "waiting", "Waiting for its first stage"
    COPYING = "copying", "Copying"
    DONE = "done", "Copied"
    FAILED = "failed", "Failed"

    @property
    def colour(self) -> str:
        return {"waiting": "grey", "copying": "blue", "done": "green", "failed": "red"}[self.value]


COPY_UNDONE = (CopyState.WAITING, CopyState.COPYING, CopyState.FAILED)  # a copy may (re)start from these


class PipelineRunQuerySet(models.QuerySet):
    def visible_to(self, user) -> "PipelineRunQuerySet":
        return self.filter(project__in=Project.objects.visible_to(user))


class PipelineRun(models.Model):
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="pipeline_runs")
    submitted_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    name = models.CharField(max_length=200)
    params = models.JSONField(default=dict, blank=True, help_text="NAME -> value, given to every stage as env.")
    document = models.JSONField(default=dict, blank=True, help_text="The pipeline as submitted (no secret values).")
    directory = models.CharField(max_length=500, help_text="HANGAR_PIPELINE_DIR of every stage of this run.")
    rerun_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="reruns")
    from_stage = models.CharField(max_length=64, blank=True, help_text="A rerun from this stage on; blank: all.")
    idempotency_key = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    mlflow_experiment_id = models.CharField(max_length=64, blank=True)
    mlflow_run_id = models.CharField(max_length=64, blank=True, help_text="The parent run of the stages' runs.")
    copy_state = models.CharField(max_length=16, choices=CopyState.choices, blank=True)
    copy_bytes = models.BigIntegerField(default=0, help_text="Bytes of the earlier run's directory copied so far.")
    copy_total = models.BigIntegerField(default=0, help_text="Bytes the copy found to copy (its first scan).")
    copy_reason = models.CharField(max_length=500, blank=True, help_text="Why the copy failed, or what it left out.")

    objects = PipelineRunQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["submitted_by", "idempotency_key"],
                condition=~Q(idempotency_key=""),
                name="pipeline_idempotency_key_per_user",
            )
        ]

    def __str__(self) -> str:
        return f"pipeline run {self.pk} {self.name}"

    def ordered_stages(self) -> list["PipelineStage"]:
        return list(self.stages.select_related("job__cost").order_by("position"))

    @property
    def state(self) -> str:
        return pipeline_state([stage.job.state for stage in self.ordered_stages()])

    # The copy's progress, written by the agent that copies. Each is one conditional update:
    # a retried attempt begins again from waiting, copying or failed, never from done.
    def copy_began(self, total: int) -> bool:
        fields = {"copy_state": CopyState.COPYING, "copy_bytes": 0, "copy_total": total, "copy_reason": ""}
        return PipelineRun.objects.filter(pk=self.pk, copy_state__in=COPY_UNDONE).update(**fields) == 1

    def copy_progressed(self, copied: int) -> None:
        PipelineRun.objects.filter(pk=self.pk, copy_state=CopyState.COPYING).update(copy_bytes=copied)

    def copy_ended(self, done: bool, copied: int, reason: str = "") -> bool:
        state = CopyState.DONE if done else CopyState.FAILED
        fields = {"copy_state": state, "copy_bytes": copied, "copy_reason": reason[:500]}
        return PipelineRun.objects.filter(pk=self.pk, copy_state__in=COPY_UNDONE).update(**fields) == 1

    def record_uid(self, uid: int) -> None:
        """A stage of this run runs as `uid` on some node (one row per uid, whoever writes first)."""
        PipelineUid.objects.bulk_create([PipelineUid(run=self, uid=uid)], ignore_conflicts=True)


class PipelineUid(models.Model):
    """A uid a stage of the run ran as: what the files in its directory may be owned by."""

    run = models.ForeignKey(PipelineRun, on_delete=models.CASCADE, related_name="uids")
    uid = models.PositiveIntegerField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "uid"], name="pipeline_uid_unique")]

    def __str__(self) -> str:
        return f"uid {self.uid} of pipeline run {self.run_id}"


class PipelineStage(models.Model):
    """One named stage of a run: the job that runs it, or, in a rerun from a later stage,
    the earlier run's job whose output it reuses (`reused`)."""

    run = models.ForeignKey(PipelineRun, on_delete=models.CASCADE, related_name="stages")
    name = models.CharField(max_length=64)
    needs = models.JSONField(default=list, blank=True, help_text="Names of the stages it waits for.")
    position = models.PositiveSmallIntegerField(help_text="Its place in a topological order of the run.")
    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="pipeline_stages")
    reused = models.BooleanField(default=False, help_text="Not run again: the earlier run's job and output.")

    class Meta:
        ordering = ["run", "position"]
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="pipeline_stage_name_unique")]
        indexes = [models.Index(fields=["job", "reused"])]

    def __str__(self) -> str:
        return f"stage {self.name} of pipeline run {self.run_id}"

    @property
    def state(self) -> str:
        return self.job.state
