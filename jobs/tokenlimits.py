"""Limits of an API token on the jobs submitted with it (portal.models.ApiToken.LIMIT_FIELDS):
`max_running_jobs` and `max_gpus` over its unfinished jobs (queued or running) at once,
`max_gpu_hours_per_day` and `max_spend_per_day` over the UTC day's attempts of its jobs.

`check` runs in the submit's transaction (jobs/submission.py), so the API, the CLI and
resubmits obey it alike, and a refused submit creates nothing. The token's row is locked
first: two submits of one token at once are counted one after the other. A refusal says
which limit, what is used and when it frees: 429 with Retry-After for the running-job,
GPU and GPU-hour caps (they free by themselves), 403 for spend.

The same read refuses a submit for a token revoked (or a user deactivated) since the request
that began the work: a sweep submits its later variants, and another web process remembers a
token for a few seconds. `acting_refusal` says why such later work (a sweep's next variant, a
pipeline's next stage) may create nothing more: its token revoked, its submitter deactivated
or no longer a member of its project. (Tokens do not expire; a revocation is their end.)

The arithmetic (`usage_refusal`, `spend_today`) and `acting_refusal_of` are plain functions
over plain data.
"""

from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from decimal import Decimal

from django.db.models import Count, F, Q, Sum
from django.utils import timezone
from rest_framework import exceptions, status

from jobs.costs import Rate, attempt_cost
from jobs.models import FINAL_JOB_STATES, Attempt, GpuRate, Job
from portal import statements
from portal.models import LIMIT_FIELDS, ApiToken, Role, project_with_role

NO_ESTIMATE_RETRY_SECONDS = 30
MAX_RETRY_SECONDS = 3600


class TokenBusy(exceptions.APIException):
    """A cap that frees by itself: 429, with Retry-After (DRF's handler sends `wait`)."""

    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_code = "token_limit"

    def __init__(self, field: str, message: str, wait: int):
        super().__init__({f"token.{field}": message})
        self.wait = wait


class TokenSpendLimit(exceptions.APIException):
    status_code = status.HTTP_403_FORBIDDEN
    default_code = "token_limit"

    def __init__(self, field: str, message: str):
        super().__init__({f"token.{field}": message})


@dataclass(frozen=True)
class Usage:
    running_jobs: int
    gpus: int
    gpu_hours_today: float
    spend_today: Decimal
    soonest_end: datetime | None  # the earliest max-runtime end among its running attempts
    day_ends: datetime

    def as_dict(self) -> dict:
        return {
            "running_jobs": self.running_jobs,
            "gpus": self.gpus,
            "gpu_hours_today": round(self.gpu_hours_today, 4),
            "spend_today": str(self.spend_today),
            "day_ends": self.day_ends.isoformat(),
        }


def day_bounds(now: datetime) -> tuple[datetime, datetime]:
    start = datetime.combine(now.astimezone(UTC).date(), time.min, tzinfo=UTC)
    return start, start + timedelta(days=1)


def clipped_cost(gpus: int, started, running, finished, rates: list[Rate], since: datetime, now: datetime):
    """An attempt's GPU time and cost from `since` on (the part of it in today)."""
    started = max(started, since) if started else None
    running = max(running, since) if running else None
    return attempt_cost(gpus, started, running, finished, rates, now)


def usage(token: ApiToken, now: datetime | None = None) -> Usage:
    now = now or timezone.now()
    since, day_ends = day_bounds(now)
    unfinished = Job.objects.filter(submitted_with=token).exclude(state__in=FINAL_JOB_STATES)
    counted = unfinished.aggregate(jobs=Count("pk"), gpus=Sum(F("gpus_per_node") * F("nodes")))
    attempts = Attempt.objects.filter(job__submitted_with=token, started_at__isnull=False).filter(
        Q(finished_at__isnull=True) | Q(finished_at__gte=since)
    )
    rates: dict[str, list[Rate]] = {}
    gpu_seconds, spend, soonest = 0.0, Decimal(0), None
    for attempt in attempts.select_related("node", "job"):
        gpu_type = attempt.node.gpu_model
        rates.setdefault(gpu_type, GpuRate.rates_for(gpu_type))
        gpus = sum(len(rank["gpus"]) for rank in attempt.ranks) or attempt.job.gpus
        times = attempt.started_at, attempt.running_at, attempt.finished_at
        cost = clipped_cost(gpus, *times, rates[gpu_type], since, now)
        gpu_seconds += cost.gpu_seconds
        spend += cost.cost
        if attempt.finished_at is None:
            end = attempt.started_at + timedelta(seconds=attempt.job.max_runtime_seconds)
            soonest = end if soonest is None else min(soonest, end)
    return Usage(counted["jobs"] or 0, counted["gpus"] or 0, gpu_seconds / 3600, spend, soonest, day_ends)


def usage_refusal(limits: dict, used: Usage, gpus: int, now: datetime) -> Exception | None:
    """The refusal of one more job of `gpus` GPUs under `limits`, or None when it fits."""
    midnight = max(1, int((used.day_ends - now).total_seconds()))
    at_midnight = f"it frees at 00:00 UTC, in {midnight // 3600}h{midnight % 3600 // 60:02d}m"
    if (limit := limits.get("max_running_jobs")) is not None and used.running_jobs >= limit:
        wait, when = frees(used, now)
        message = f"this token has {used.running_jobs} unfinished jobs (queued or running) of max_running_jobs={limit}"
        return TokenBusy("max_running_jobs", f"{message}; {when}; retry after {wait}s (Retry-After)", wait)
    if (limit := limits.get("max_gpus")) is not None and used.gpus + gpus > limit:
        wait, when = frees(used, now)
        message = f"this token's unfinished jobs hold {used.gpus} GPUs, this one asks for {gpus}: over max_gpus={limit}"
        return TokenBusy("max_gpus", f"{message}; {when}; retry after {wait}s (Retry-After)", wait)
    if (limit := limits.get("max_gpu_hours_per_day")) is not None and used.gpu_hours_today >= float(limit):
        message = f"this token's jobs used {used.gpu_hours_today:.2f} GPU-hours today of max_gpu_hours_per_day={limit}"
        return TokenBusy("max_gpu_hours_per_day", f"{message}; {at_midnight} (Retry-After)", midnight)
    if (limit := limits.get("max_spend_per_day")) is not None and used.spend_today >= limit:
        message = f"this token's jobs spent {used.spend_today:.2f} today of max_spend_per_day={limit:.2f}"
        return TokenSpendLimit("max_spend_per_day", f"{message}; {at_midnight}, or ask for a higher limit")
    return None


def frees(used: Usage, now: datetime) -> tuple[int, str]:
    """(Retry-After seconds, when a slot frees) for the running-job and GPU caps."""
    if used.soonest_end is None:
        return NO_ESTIMATE_RETRY_SECONDS, "a slot frees when one of them ends or is cancelled"
    seconds = int((used.soonest_end - now).total_seconds())
    wait = min(max(1, seconds), MAX_RETRY_SECONDS)
    end = used.soonest_end.astimezone(UTC)
    return wait, f"one frees when a job ends: at the latest by {end:%Y-%m-%d %H:%M:%S} UTC (its max runtime)"


class TokenEnded(exceptions.APIException):
    """A submit for a token that was revoked, or whose user was deactivated, since the work that
    submits it began (a sweep's next variant): that work stops, saying why."""

    status_code = status.HTTP_403_FORBIDDEN
    default_code = "token_ended"

    def __init__(self, message: str):
        super().__init__({"token": message})


@statements.query
def token_standing(pk: int):
    """Whether the token still acts (revoked when, its user active) and its limits, in one read."""
    return ApiToken.objects.filter(pk=pk).values_list("revoked_at", "user__is_active", *LIMIT_FIELDS)[:1]


def check(token_id: int | None, gpus: int) -> None:
    """Refuse a submit for a revoked token, or one over the token's limits (call inside the
    submit's transaction). The request that began the work authenticated the token, but a
    sweep or a pipeline submits later, and another web process remembers a token for
    HANGAR_API_TOKEN_CACHE_SECONDS: this read is the last word."""
    if token_id is None:
        return
    standing = token_standing.first(pk=token_id)
    if standing is None:  # deleted: the job could not name it either
        raise TokenEnded("the API token it is submitted with was deleted")
    revoked_at, user_active, *limits = standing
    if revoked_at is not None:
        raise TokenEnded(f"the API token it is submitted with was revoked at {revoked_at:%Y-%m-%d %H:%M:%S} UTC")
    if not user_active:
        raise TokenEnded("the API token it is submitted with belongs to a deactivated user")
    # Only a token with limits is locked (its submits take turns, so each counts the ones
    # before it): locking every token made an agent's parallel submits with one unlimited
    # token wait for each other (16 at once: ~48 ms each in the lock, bench/throughput.py).
    # A limit set (or a revocation made) while such a submit runs counts from the submits after it.
    if all(value is None for value in limits):
        return
    token = ApiToken.objects.select_for_update().filter(pk=token_id).first()
    if token is None or not any(value is not None for value in token.limits.values()):
        return
    if token.max_gpus is not None and gpus > token.max_gpus:
        raise exceptions.ValidationError(
            {"gpus_per_node": f"asks for {gpus} GPUs; this token allows at most {token.max_gpus} at once (max_gpus)"}
        )
    now = timezone.now()
    if (refusal := usage_refusal(token.limits, usage(token, now), gpus, now)) is not None:
        raise refusal


# --- work that goes on after its request: sweeps' next variants, pipelines' next stages ----


@dataclass(frozen=True)
class Acting:
    """Who later work acts for, as it stands now."""

    username: str
    user_active: bool
    member: bool  # still a member (or higher) of the work's project, within the token's project limit
    project: str
    token: str = ""  # "'name' (hint…)"; "" for work submitted from a browser session
    token_state: str = ""  # active, revoked or deleted; "" without a token


def acting_refusal_of(acting: Acting) -> str | None:
    """Why the work may create no more jobs, or None."""
    if acting.token_state in ("revoked", "deleted"):
        token = f"API token {acting.token}" if acting.token else "API token"
        return f"the {token} it was submitted with was {acting.token_state}; submit it again with an active token"
    if not acting.user_active:
        return f"{acting.username}, who submitted it, was deactivated"
    if not acting.member:
        return f"{acting.username}, who submitted it, is no longer a member of {acting.project} who may submit jobs"
    return None


def job_acting_refusal(job: Job, known: dict | None = None) -> str | None:
    """`acting_refusal` for the user, token and project `job` records. `known`: the verdicts a
    pass over many jobs found so far, by those three ids: one submitter's jobs are looked at once."""
    who = (job.submitted_by_id, job.submitted_with_id, job.project_id)
    known = {} if known is None else known
    if who not in known:
        known[who] = acting_refusal(job.submitted_by, job.submitted_with_id, job.project)
    return known[who]


def acting_refusal(user, token_id: int | None, project) -> str | None:
    """Why work submitted earlier for `user` (with the token `token_id`) may create no more jobs
    in `project` now, or None. Sets on `user` what the token's authentication sets (its project
    limit, its id for the limits), so what the work submits next is the token's, as at first.
    `user` is read with the work (its is_active is that read's)."""
    token = ApiToken.objects.filter(pk=token_id).first() if token_id else None
    state = "" if not token_id else "deleted" if token is None else "revoked" if token.revoked_at else "active"
    if token is not None:
        token.limit(user)
    acting = Acting(
        username=user.username,
        user_active=user.is_active,
        member=project_with_role(user, project.slug, Role.MEMBER) is not None,
        project=project.slug,
        token=f"{token.name!r} ({token.hint}…)" if token is not None else "",
        token_state=state,
    )
    return acting_refusal_of(acting)
