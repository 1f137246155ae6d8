"""The agents' loop as one figure set (issue 19): how close to ideal a sweep runs, and what
`submit --code` costs when the code did and did not change.

Starts a whole Hangar with two node agents of 4 simulated GPUs each (2 x 4) and warms each
agent with one job first (an agent's first job opens its MLflow store: start-up, not the
loop's cost). Then, in the same stack:
- a sweep of 16 variants of a 2-second job (bench/sweep.py's: `metrics_from_log` reads its
  `val_loss`, `max_parallel` 8), timed from creating it to its last variant's end, against
  the ideal 16 x 2 / 8 = 4 s;
- a 20 MB snapshot (bench/snapshots.py's: 20 files of random bytes) made sure of through
  the real client, changed (one file rewritten: the hash asked for, then the upload) and
  unchanged (the hash asked for, and nothing else), medians over the runs.

    python bench/agent_loop.py [--quick] [--variants 16] [--seconds 2] [--mb 20] [--runs N]

On PostgreSQL/Redis when DATABASE_URL, CELERY_BROKER_URL and REDIS_URL are set (LiveStack
passes the environment on). Last line: variants=.. wall_s=.. ideal_s=.. efficiency=..
upload_unchanged_ms=.. upload_changed_ms=.. unchanged_round_trips=..
"""

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.snapshots import make_tree, measure_on  # noqa: E402
from bench.sweep import time_sweep, warm_up  # noqa: E402
from tests.livestack import UNSANDBOXED, LiveStack  # noqa: E402


def run(variants: int, seconds: float, megabytes: int, runs: int) -> tuple[dict, dict]:
    root = Path(tempfile.mkdtemp(prefix="hangar-bench-loop-"))
    try:
        make_tree(root, megabytes)
        with LiveStack(env={**UNSANDBOXED, "HANGAR_SIM_GPUS": "4"}) as stack:
            stack.start_agent("node-b", gpus=4)
            print("warming each of the 2 agents with one 4-GPU job first (its first job opens MLflow)", flush=True)
            warm_up(stack)
            sweep = time_sweep(stack, variants, seconds)
            print(f"sweep: {variants} variants of {seconds:g} s in {sweep['wall_s']:.2f} s", flush=True)
            snapshot = measure_on(stack, root, runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return sweep, snapshot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 variants of 1 s, 3 snapshot runs")
    parser.add_argument("--variants", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--mb", type=int, default=20, help="the snapshot's size (1 MB files)")
    parser.add_argument("--runs", type=int, help="snapshot runs (default 5; --quick 3)")
    args = parser.parse_args()
    variants, seconds = (8, 1.0) if args.quick else (args.variants, args.seconds)
    runs = args.runs or (3 if args.quick else 5)
    sweep, snapshot = run(variants, seconds, args.mb, runs)
    mode = "services (PostgreSQL/Redis)" if os.environ.get("DATABASE_URL") else "embedded (SQLite)"
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{mode}; load average {load} on {os.cpu_count()} cores")
    print(f"{sweep['failed']} of {variants} variants did not succeed; mean seconds per variant: "
          + ", ".join(f"{k} {v:.2f}" for k, v in sweep["phases"].items()))  # fmt: skip
    print(f"snapshot: {args.mb} MB ({snapshot['wire_mb']:.1f} MB on the wire), pack {snapshot['pack_ms']:.0f} ms")
    print(
        f"variants={variants} wall_s={sweep['wall_s']:.2f} ideal_s={sweep['ideal_s']:.2f} "
        f"efficiency={sweep['efficiency']:.2f} upload_unchanged_ms={snapshot['upload_unchanged_ms']:.1f} "
        f"upload_changed_ms={snapshot['upload_changed_ms']:.0f} "
        f"unchanged_round_trips={snapshot['unchanged_round_trips']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
