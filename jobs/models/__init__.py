"""The jobs app's models, one module each: states, environments, jobs (and their history),
attempts, log lines, cost, code snapshots. Everything is re-exported here: `from jobs.models import Job`."""

from jobs.models.attempt import Attempt, lease_from, requeue_for
from jobs.models.cost import Budget, CostDaily, GpuRate, JobCost, attempt_cost_of, next_month
from jobs.models.environment import Environment, EnvironmentKind, EnvironmentRebuild
from jobs.models.job import Job, JobEvent, JobQuerySet, Launcher
from jobs.models.logs import LogLine, Severity, Stream
from jobs.models.notify import Channel, Delivery, DeliveryState, Event, Subscription
from jobs.models.pipeline import PipelineRun, PipelineRunQuerySet, PipelineStage, PipelineState, pipeline_state
from jobs.models.snapshot import Snapshot, SnapshotChunk
from jobs.models.states import (
    ACTIVE_ATTEMPT_STATES,
    FINAL_JOB_STATES,
    STARTED_ATTEMPT_STATES,
    STATE_COLOURS,
    AttemptState,
    FailureClass,
    JobState,
)
from jobs.models.sweep import Sweep, SweepQuerySet
from jobs.priority import Priority, PriorityClass, priority_class, priority_classes

__all__ = [
    "ACTIVE_ATTEMPT_STATES",
    "FINAL_JOB_STATES",
    "STARTED_ATTEMPT_STATES",
    "STATE_COLOURS",
    "Attempt",
    "AttemptState",
    "Budget",
    "Channel",
    "CostDaily",
    "Delivery",
    "DeliveryState",
    "Environment",
    "EnvironmentKind",
    "EnvironmentRebuild",
    "Event",
    "FailureClass",
    "GpuRate",
    "Job",
    "JobCost",
    "JobEvent",
    "JobQuerySet",
    "JobState",
    "Launcher",
    "LogLine",
    "PipelineRun",
    "PipelineRunQuerySet",
    "PipelineStage",
    "PipelineState",
    "Priority",
    "PriorityClass",
    "Severity",
    "Snapshot",
    "SnapshotChunk",
    "Stream",
    "Subscription",
    "Sweep",
    "SweepQuerySet",
    "attempt_cost_of",
    "lease_from",
    "next_month",
    "pipeline_state",
    "priority_class",
    "priority_classes",
    "requeue_for",
]
