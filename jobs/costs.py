"""GPU cost arithmetic: plain functions over plain data, no database.

An attempt costs GPUs x (preflight time + running time) x the GPU-hour rate in
force at each moment: a rate applies from its effective time on, so a rate
change in the middle of an attempt splits it, and a later change never alters
a past cost. Amounts are Decimals rounded to 1/10000 of the currency unit.
"""

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal

QUANTUM = Decimal("0.0001")
SECONDS_PER_HOUR = Decimal(3600)


@dataclass(frozen=True)
class Rate:
    effective_from: datetime
    per_gpu_hour: Decimal


@dataclass(frozen=True)
class AttemptCost:
    gpus: int
    preflight_seconds: float
    running_seconds: float
    preflight_cost: Decimal
    running_cost: Decimal
    label: str

    @property
    def cost(self) -> Decimal:
        return self.preflight_cost + self.running_cost

    @property
    def gpu_seconds(self) -> float:
        return self.gpus * (self.preflight_seconds + self.running_seconds)


# What an attempt's cost is labelled in tables and charts. Wasted spend is the
# spend of failed, lost and preempted attempts.
WASTED_LABELS = ("failed", "lost", "preempted")
LABELS = ("succeeded", "running", "cancelled", "failed", "lost", "preempted")


def label_for(state: str, failure_class: str) -> str:
    if failure_class == "preempted":
        return "preempted"
    if state in ("scheduled", "preflight", "running"):
        return "running"
    if state in LABELS:
        return state
    return "failed"


def money(value: Decimal) -> Decimal:
    return value.quantize(QUANTUM, rounding=ROUND_HALF_UP)


def interval_cost(gpus: int, start: datetime | None, end: datetime | None, rates: list[Rate]) -> Decimal:
    """Cost of `gpus` GPUs held from start to end under `rates` (any order).

    Time before the first rate's effective time costs nothing: there was no rate.
    """
    if start is None or end is None or end <= start or gpus <= 0:
        return Decimal(0)
    ordered = sorted(rates, key=lambda r: r.effective_from)
    total = Decimal(0)
    for i, rate in enumerate(ordered):
        until = ordered[i + 1].effective_from if i + 1 < len(ordered) else end
        lo, hi = max(start, rate.effective_from), min(end, until)
        if hi > lo:
            seconds = Decimal(str((hi - lo).total_seconds()))
            total += gpus * seconds * rate.per_gpu_hour / SECONDS_PER_HOUR
    return money(total)


def attempt_cost(
    gpus: int,
    started_at: datetime | None,
    running_at: datetime | None,
    finished_at: datetime | None,
    rates: list[Rate],
    now: datetime,
    state: str = "succeeded",
    failure_class: str = "",
) -> AttemptCost:
    """Preflight runs from started_at to running_at (or the end, if the command never
    started); running from running_at to the end. An attempt not yet finished is
    costed up to `now`: the cost so far."""
    end = finished_at or now
    preflight_end = running_at or end
    return AttemptCost(
        gpus=gpus,
        preflight_seconds=_seconds(started_at, preflight_end),
        running_seconds=_seconds(running_at, end),
        preflight_cost=interval_cost(gpus, started_at, preflight_end, rates),
        running_cost=interval_cost(gpus, running_at, end, rates),
        label=label_for(state, failure_class),
    )


def _seconds(start: datetime | None, end: datetime | None) -> float:
    if start is None or end is None or end <= start:
        return 0.0
    return (end - start).total_seconds()


def job_cost(attempts: list[AttemptCost]) -> Decimal:
    return sum((a.cost for a in attempts), Decimal(0))


def wasted_share(cost_by_label: dict[str, Decimal]) -> float:
    """The share (0..1) of spend that went to failed, lost and preempted attempts."""
    total = sum(cost_by_label.values(), Decimal(0))
    if not total:
        return 0.0
    return float(sum((cost_by_label.get(k, Decimal(0)) for k in WASTED_LABELS), Decimal(0)) / total)


@dataclass(frozen=True)
class BudgetStatus:
    name: str
    amount: Decimal
    spent: Decimal
    warn_percent: int
    hard_limit: bool

    @property
    def left(self) -> Decimal:
        return max(self.amount - self.spent, Decimal(0))

    @property
    def used_percent(self) -> float:
        return float(self.spent / self.amount * 100) if self.amount else 100.0

    @property
    def warning(self) -> bool:
        return self.used_percent >= self.warn_percent

    @property
    def exhausted(self) -> bool:
        return self.spent >= self.amount

    @property
    def refuses(self) -> bool:
        return self.hard_limit and self.exhausted

    def message(self) -> str:
        return (
            f"budget {self.name} has {self.left:.2f} left of {self.amount:.2f} "
            f"(spent {self.spent:.2f}, {self.used_percent:.0f}%)"
        )
