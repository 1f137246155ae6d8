"""The states of jobs and attempts, and how an attempt failed."""

from django.db import models


class JobState(models.TextChoices):
    BLOCKED = "blocked", "Blocked"  # waiting for the jobs it depends on (jobs/dependencies.py)
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
    "blocked": "grey",
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
