"""How close to ideal does a sweep run? (issue 19's agent loop, the sweep part.)

Starts a whole Hangar with two node agents of 4 simulated GPUs each, creates one sweep of
N variants of a job that sleeps S seconds and prints its `val_loss` (read by
metrics_from_log), with max_parallel 8, and times creating the sweep until every variant
ended (after one warm-up job on each node). Ideal: ceil(N / 8) rounds of S seconds. Then
reads the sweep (its runs ranked by objective) and one result document, and times those
calls; prints the mean seconds a variant spent queued, in preflight and running (from
the result documents).

    python bench/sweep.py [--quick] [--variants N] [--seconds S]

Last line: variants=.. wall_s=.. ideal_s=.. efficiency=.. sweep_read_ms=.. result_ms=..
"""

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.livestack import UNSANDBOXED, LiveStack  # noqa: E402

PARALLEL = 8


def sweep_file(variants: int, seconds: float) -> dict:
    script = f"import os, time; time.sleep({seconds}); print('val_loss:', int(os.environ['I']) / 100, flush=True)"
    return {
        "name": "bench-sweep",
        "project": "default",
        "max_parallel": PARALLEL,
        "objective": {"metric": "val_loss", "mode": "min"},
        "base": {
            "command": [sys.executable, "-c", script],
            "metrics_from_log": r"(?P<name>val_loss): (?P<value>\S+)",
            "max_runtime_seconds": 120,
        },
        "grid": {"env.I": [str(i) for i in range(variants)]},
    }


def states(stack: LiveStack) -> list[str]:
    jobs = stack.api("GET", "/api/v1/jobs/", params={"name": "bench-sweep", "limit": 200}).json()["results"]
    return [job["state"] for job in jobs]


def warm_up(stack: LiveStack) -> None:
    """One job on each node first: an agent's first job opens its MLflow store (imports, tables),
    which is start-up cost, not the sweep's."""
    jobs = [stack.submit(["true"], gpus_per_node=4, name="warm-up") for _ in range(2)]
    for job in jobs:
        stack.wait_for(job["id"], ("succeeded", "failed"), timeout=300)


def run(variants: int, seconds: float) -> dict:
    with LiveStack(env={**UNSANDBOXED, "HANGAR_SIM_GPUS": "4"}) as stack:
        stack.start_agent("node-b", gpus=4)
        warm_up(stack)
        return time_sweep(stack, variants, seconds)


def time_sweep(stack: LiveStack, variants: int, seconds: float) -> dict:
    """Create the sweep and time it until its last variant ended; read it and its results."""
    started = time.monotonic()
    created = stack.api("POST", "/api/v1/sweeps/", json=sweep_file(variants, seconds))
    created.raise_for_status()
    sweep_id = created.json()["id"]
    while True:
        now = states(stack)
        if len(now) == variants and all(s in ("succeeded", "failed", "cancelled") for s in now):
            break
        if time.monotonic() - started > 600:
            raise RuntimeError(f"the sweep did not end in 600 s: {now}\n{stack.output()}")
        time.sleep(0.1)
    wall = time.monotonic() - started
    t0 = time.monotonic()
    doc = stack.api("GET", f"/api/v1/sweeps/{sweep_id}/").json()
    cold_ms = (time.monotonic() - t0) * 1000  # the web process's first MLflow use opens its client
    t0 = time.monotonic()
    doc = stack.api("GET", f"/api/v1/sweeps/{sweep_id}/").json()
    read_ms = (time.monotonic() - t0) * 1000
    t0 = time.monotonic()
    stack.api("GET", f"/api/v1/jobs/{doc['best']['job']}/result/").raise_for_status()
    result_ms = (time.monotonic() - t0) * 1000
    failed = sum(1 for s in now if s != "succeeded")
    assert doc["best"]["params"] == {"env.I": "0"}, doc["best"]
    times = [stack.api("GET", f"/api/v1/jobs/{r['job']}/result/").json()["times"] for r in doc["runs"]]
    phases = {k: sum(t[f"{k}_seconds"] for t in times) / len(times) for k in ("queued", "preflight", "running")}
    ideal = math.ceil(variants / PARALLEL) * seconds
    return {"variants": variants, "failed": failed, "wall_s": wall, "ideal_s": ideal, "efficiency": ideal / wall,
            "sweep_read_ms": read_ms, "sweep_first_read_ms": cold_ms, "result_ms": result_ms,
            "phases": phases}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 variants of 1 s")
    parser.add_argument("--variants", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    variants, seconds = (8, 1.0) if args.quick else (args.variants, args.seconds)
    found = run(variants, seconds)
    print(f"{found['failed']} of {found['variants']} variants did not succeed")
    print(f"first sweep read (the web process opens MLflow): {found['sweep_first_read_ms']:.0f} ms")
    print("mean seconds per variant: " + ", ".join(f"{k} {v:.2f}" for k, v in found["phases"].items()))
    print(
        f"variants={found['variants']} wall_s={found['wall_s']:.2f} ideal_s={found['ideal_s']:.2f} "
        f"efficiency={found['efficiency']:.2f} sweep_read_ms={found['sweep_read_ms']:.0f} "
        f"result_ms={found['result_ms']:.0f}"
    )


if __name__ == "__main__":
    main()
