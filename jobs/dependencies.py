"""Jobs that wait for other jobs: `depends_on: [{"job": 12, "on": "succeeded" | "finished"}]`.

A job with an unmet dependency is `blocked`: not placed, not counted against any quota,
with the reason it waits. When a job it depends on ends, it becomes `queued` if every
dependency is met, or is cancelled, saying why, if one can no longer be (a job it needed
to succeed failed or was cancelled); its own dependents are then settled the same way.
A dependency names a job that exists already, so no cycle can form.
"""

from dataclasses import dataclass

from django.db import transaction
from django.dispatch import receiver
from django.utils import timezone

from jobs import tokenlimits
from jobs.models import FINAL_JOB_STATES, FailureClass, Job, JobEvent, JobState
from jobs.signals import attempt_finished, job_ended
from portal import statements, wakeup

ON = ("succeeded", "finished")


@dataclass(frozen=True)
class Verdict:
    kind: str  # met, waiting, never; stopped: what it acts for ended (jobs/tokenlimits.py)
    reason: str = ""


def verdict(depends_on: list[dict], states: dict[int, str]) -> Verdict:
    """Where a job stands on its dependencies, given the states of the jobs they name."""
    waiting = []
    for dep in depends_on:
        job_id, state = dep["job"], states.get(dep["job"])
        if state is None:
            return Verdict("never", f"job {job_id}, which it depends on, no longer exists")
        if dep["on"] == "succeeded" and state in FINAL_JOB_STATES and state != JobState.SUCCEEDED:
            return Verdict("never", f"job {job_id} {state}, and this job needed it to succeed")
        if state not in FINAL_JOB_STATES:
            waiting.append(f"job {job_id} ({state})")
    if waiting:
        return Verdict("waiting", "waiting for " + ", ".join(waiting))
    return Verdict("met")


def standing(depends_on: list[dict]) -> Verdict:
    states = dict(Job.objects.filter(pk__in=[d["job"] for d in depends_on]).values_list("pk", "state"))
    return verdict(depends_on, states)


def settle(job: Job, acting: dict | None = None) -> None:
    """Move a blocked job on if its dependencies now allow it (a conditional update: safe twice).
    `acting`: who may still start jobs, as found for the jobs settled before it in one pass."""
    now = timezone.now()
    found = standing(job.depends_on)
    blocked = Job.objects.filter(pk=job.pk, state=JobState.BLOCKED)
    if found.kind == "met" and (refused := tokenlimits.job_acting_refusal(job, acting)):
        # Its submitter's token was revoked, or they left the project, while it waited: it starts nothing.
        found = Verdict("stopped", refused)
    if found.kind == "met":
        if blocked.update(state=JobState.QUEUED, queued_at=now, order_at=now, state_reason=""):
            JobEvent.objects.create(job=job, kind="unblocked", message="every job it depends on is done")
            wakeup.request_pass()
    elif found.kind in ("never", "stopped"):
        ended = {"state": JobState.CANCELLED, "failure_class": FailureClass.CANCELLED, "finished_at": now}
        if blocked.update(
            **ended, state_reason=f"{'stopped' if found.kind == 'stopped' else 'cancelled'}: {found.reason}"
        ):
            JobEvent.objects.create(job=job, kind="cancel", message=found.reason)
            job_ended.send(sender=Job, job=job)  # its own dependents are settled, its watchers told
    else:
        blocked.exclude(state_reason=found.reason).update(state_reason=found.reason)


def settle_dependents(job_id: int, project_id: int | None = None) -> None:
    """A job ended: settle the blocked jobs of its project that depend on it. `project_id`
    when the caller knows the job is over (and its project); read here otherwise."""
    if project_id is None:
        job = Job.objects.filter(pk=job_id).values("state", "project_id").first()
        if job is None or job["state"] not in FINAL_JOB_STATES:
            return  # requeued, or a cancel only asked for: not over yet
        project_id = job["project_id"]
    acting: dict = {}
    for dependent in blocked_in.rows(project_id=project_id):
        if any(d["job"] == job_id for d in dependent.depends_on):
            settle(dependent, acting)


@statements.query
def blocked_in(project_id: int):
    """A project's blocked jobs, with what they depend on and whom they act for."""
    blocked = Job.objects.filter(project_id=project_id, state=JobState.BLOCKED)
    return blocked.only("depends_on", "submitted_by", "submitted_with", "project")


@receiver(attempt_finished)
def _after_an_attempt(sender, attempt, job, **kwargs) -> None:
    if job.is_final:  # requeued, or a cancel only asked for: not over yet
        transaction.on_commit(lambda: settle_dependents(job.pk, job.project_id))


@receiver(job_ended)
def _after_a_cancel(sender, job, **kwargs) -> None:
    transaction.on_commit(lambda: settle_dependents(job.pk))
