"""Hangs and stragglers while an attempt runs: the pure half of the reconciler's checks
(jobs/diagnosing.py loads each rank's last line and applies them)."""

from dataclasses import dataclass

from jobs.diagnosis.output import linear


@dataclass(frozen=True)
class Hang:
    ranks: tuple[int, ...]  # the silent ranks
    summary: str


def hang_suspected(
    last_output: dict[int, float | None],
    now: float,
    started: float,
    hang_seconds: float,
    world_size: int,
    gpus_idle: bool | None = None,
) -> Hang | None:
    """A rank silent for `hang_seconds` while another printed within that time; or every rank silent
    that long with its GPUs idle per telemetry (None: unknown, as on nodes without telemetry).
    `last_output` is each rank's last line time (None: no line yet, counted from `started`)."""
    if now - started < hang_seconds:
        return None
    seen = {r: (last_output.get(r) or started) for r in range(world_size)}
    silent = tuple(sorted(r for r, t in seen.items() if now - t >= hang_seconds))
    if not silent:
        return None
    if len(silent) < world_size:
        names = ", ".join(map(str, silent))
        return Hang(silent, f"rank {names} silent for over {hang_seconds:g}s while the other ranks print")
    if gpus_idle:
        return Hang(silent, f"every rank silent for over {hang_seconds:g}s and its GPUs idle")
    return None


# --- stragglers ---------------------------------------------------------------------------------

_STEP = linear(r"\b(?:step|iter(?:ation)?|global_step)\s*[:=#]?\s*(\d+)", ignore_case=True)
STRAGGLER_FRACTION = 0.2  # a rank this far behind the leader's step count
STRAGGLER_MIN_STEPS = 5  # and at least this many steps behind (early noise is no straggler)


def step_of(text: str) -> int | None:
    """The step number a training line prints ("step 120", "iter=120", "global_step: 120"), if any."""
    match = _STEP.search(text)
    return int(match.group(1)) if match else None


def straggling(steps: dict[int, int]) -> Hang | None:
    """Ranks whose latest printed step is well below the leading rank's: they started together, so
    their step rate is that much lower, and every collective waits for them."""
    if len(steps) < 2:
        return None
    lead = max(steps.values())
    slow = tuple(
        sorted(r for r, s in steps.items() if s <= lead * (1 - STRAGGLER_FRACTION) and lead - s >= STRAGGLER_MIN_STEPS)
    )
    if not slow:
        return None
    behind = ", ".join(f"rank {r} at step {steps[r]}" for r in slow)
    return Hang(slow, f"straggler: {behind} while the leading rank is at step {lead}")
