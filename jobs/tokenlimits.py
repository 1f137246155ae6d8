"""Limits of an API token on the jobs submitted with it (portal.models.ApiToken.LIMIT_FIELDS):
`max_running_jobs` and `max_gpus` over its unfinished jobs (queued or running) at once,
`max_gpu_hours_per_day` and `max_spend_per_day` over the UTC day's attempts of its jobs.

`check` runs in the submit's transaction (jobs/submission.py), so the API, the CLI and
resubmits obey it alike, and a refused submit creates nothing. The token's row is locked
first: two submits of one token at once are counted one after the other. A refusal says
which limit, what is used and when it frees: 429 with Retry-After for the running-job,
GPU and GPU-hour caps (they free by themselves), 403 for spend.

The arithmetic (`usage_refusal`, `spend_today`) is plain functions over plain data.
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
from portal.models import LIMIT_FIELDS, ApiToken

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


@statements.query
def limited_token(pk: int):
    """The token, if it has a limit."""
    return ApiToken.objects.filter(pk=pk).exclude(**{name: None for name in LIMIT_FIELDS}).values_list("pk")[:1]


def check(token_id: int | None, gpus: int) -> None:
    """Refuse a submit over the token's limits (call inside the submit's transaction)."""
    if token_id is None:
        return
    # Only a token with limits is locked (its submits take turns, so each counts the ones
    # before it): locking every token made an agent's parallel submits with one unlimited
    # token wait for each other (16 at once: ~48 ms each in the lock, bench/throughput.py).
    # A limit set while such a submit runs counts from the submits after it.
    if limited_token.first(pk=token_id) is None:
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
