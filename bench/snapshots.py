"""How long does `hangar submit --code DIR` spend on a 20 MB directory?

Starts a whole Hangar (`manage.py up`) in a temporary data directory and, through the
real client (hangar.client, hangar.snapshots: what the CLI runs), packs a directory of
20 files of 1 MB of random bytes (incompressible: the bytes on the wire are the MB) and
makes sure the project has it: unchanged, that is one request (the server already has the
hash); changed (one file rewritten), the same request and then the upload, which the
server hashes, checks member by member and stores. Times are medians over the runs;
packing (reading, tar, gzip, sha256) is timed apart.

    python bench/snapshots.py [--quick] [--mb 20] [--runs N]

Last line: snapshot_mb=... pack_ms=... unchanged_round_trips=... upload_unchanged_ms=... upload_changed_ms=...
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hangar.client import Client  # noqa: E402
from hangar.snapshots import pack  # noqa: E402
from tests.livestack import UNSANDBOXED, LiveStack  # noqa: E402

PROJECT = "default"


def make_tree(root: Path, megabytes: int) -> None:
    for index in range(megabytes):
        (root / f"part-{index:03d}.bin").write_bytes(os.urandom(1024 * 1024))
    (root / "train.py").write_text("print('hello')\n")


def timed(action, *args, **kwargs) -> tuple[float, object]:
    started = time.perf_counter()
    result = action(*args, **kwargs)
    return (time.perf_counter() - started) * 1000, result


def measure(client: Client, root: Path, runs: int, requests: list) -> dict:
    packs, unchanged, changed, round_trips = [], [], [], []
    for run in range(runs):
        (root / "part-000.bin").write_bytes(os.urandom(1024 * 1024))  # a changed tree
        ms, packed = timed(pack, root, limit_mb=1000)
        packs.append(ms)
        ms, (_, uploaded) = timed(client.ensure_snapshot, PROJECT, packed.sha256, packed.data)
        assert uploaded, "a changed tree must be uploaded"
        changed.append(ms)
        again = pack(root, limit_mb=1000)  # unchanged since
        assert again.sha256 == packed.sha256
        requests.clear()
        ms, (_, uploaded) = timed(client.ensure_snapshot, PROJECT, again.sha256, again.data)
        assert not uploaded, "an unchanged tree must not be uploaded"
        unchanged.append(ms)
        round_trips.append(len(requests))
        print(f"run {run + 1}: pack {packs[-1]:.0f} ms, changed {changed[-1]:.0f} ms, unchanged {ms:.1f} ms")
    return {
        "pack_ms": statistics.median(packs),
        "unchanged_round_trips": max(round_trips),
        "upload_unchanged_ms": statistics.median(unchanged),
        "upload_changed_ms": statistics.median(changed),
        "wire_mb": len(packed.data) / 1024 / 1024,
    }


def measure_on(stack: LiveStack, root: Path, runs: int) -> dict:
    """`measure` through a client of the stack's token that counts its requests."""
    requests: list = []
    client = Client(stack.url, stack.token)
    client.http.event_hooks["request"] = [requests.append]
    return measure(client, root, runs, requests)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 runs")
    parser.add_argument("--mb", type=int, default=20, help="size of the directory (1 MB files)")
    parser.add_argument("--runs", type=int, help="default 7 (--quick: 3)")
    args = parser.parse_args()
    runs = args.runs or (3 if args.quick else 7)
    root = Path(tempfile.mkdtemp(prefix="hangar-bench-code-"))
    try:
        make_tree(root, args.mb)
        with LiveStack(env=UNSANDBOXED) as stack:
            figures = measure_on(stack, root, runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"snapshot_mb={args.mb} wire_mb={figures['wire_mb']:.1f} runs={runs} pack_ms={figures['pack_ms']:.0f} "
        f"unchanged_round_trips={figures['unchanged_round_trips']} "
        f"upload_unchanged_ms={figures['upload_unchanged_ms']:.1f} upload_changed_ms={figures['upload_changed_ms']:.0f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
