"""How fast does a job with Python requirements start, the first time and once cached?

Starts a whole Hangar (`manage.py up`, jobs unsandboxed) in a temporary data directory and
times, submit -> the job's first output line stored in the database:

- the first job with a 3-package requirement set: resolved and built by uv (build_s);
- later jobs with the same requirements, which find the cached environment (cached_start_ms);
- bare jobs (no requirements) running the same interpreter, in turns with the cached ones
  (bare_start_ms); cached_extra_ms = cached - bare (goal: at most 50).

Each job prints its first line before anything else, so both measure the start, not imports.
On a busy machine the stack's own noise is larger than the difference, so the agent's cached
path alone (envcache.prepare on a hit: key lookup, shared lock, usage note) is timed in
process too (prepare_cached_ms, p50 of 200).

Then a second agent joins and a Ray job (`launcher: ray`, ray==2.60.0 from a cached environment)
runs on 2 nodes, twice: submit -> its driver's first line, the first time with the Ray
environment's build (ray_first_driver_start_s) and then with it cached (ray_driver_start_s: two
`ray start`s, the join check, the driver). `--no-ray` leaves it out (it adds a minute or more).

    python bench/environments.py [--quick] [--jobs N] [--no-ray]

Last line: build_s=... cached_start_ms=... bare_start_ms=... cached_extra_ms=... prepare_cached_ms=...
ray_driver_start_s=...
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.livestack import UNSANDBOXED  # noqa: E402

REQUIREMENTS = ["six==1.17.0", "idna==3.10", "attrs==25.3.0"]
FIRST_LINE = "print('started', flush=True); import sys; print(sys.prefix)"


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def time_start(stack, command: list[str], timeout: float = 600, **fields) -> tuple[float, dict]:
    """Milliseconds from submit to the job's first stdout line stored; and the ended job."""
    from jobs.models import LogLine, Stream

    started = time.perf_counter()
    job = stack.submit(command, name="env-bench", **fields)
    deadline = time.monotonic() + timeout
    while not LogLine.objects.filter(job_id=job["id"], stream=Stream.STDOUT).exists():
        if time.monotonic() > deadline or stack.job(job["id"])["state"] in ("failed", "cancelled"):
            raise SystemExit(f"job {job['id']} printed nothing: {stack.job(job['id'])}")
        time.sleep(0.002)
    elapsed = (time.perf_counter() - started) * 1000
    return elapsed, stack.wait_for(job["id"], ("succeeded", "failed"), timeout=60)


RAY_DRIVER = "print('driver started', flush=True); import ray; ray.init(); print('nodes', len(ray.nodes()))"


def time_ray_driver(stack, timeout: float = 900) -> float:
    """Seconds from submit to a 2-node Ray job's driver printing its first line (rank 0)."""
    from jobs.models import LogLine

    started = time.perf_counter()
    job = stack.submit(
        ["python", "-c", RAY_DRIVER], name="ray-bench", requirements=["ray==2.60.0"], launcher="ray", nodes=2
    )
    deadline = time.monotonic() + timeout
    while not LogLine.objects.filter(job_id=job["id"], rank=0, text="driver started").exists():
        if time.monotonic() > deadline or stack.job(job["id"])["state"] in ("failed", "cancelled", "succeeded"):
            raise SystemExit(f"Ray job {job['id']}'s driver did not start: {stack.job(job['id'])['state_reason']}")
        time.sleep(0.01)
    elapsed = time.perf_counter() - started
    done = stack.wait_for(job["id"], ("succeeded", "failed"), timeout=120)
    if done["state"] != "succeeded":
        raise SystemExit(f"Ray job {job['id']} failed: {done['state_reason']}")
    return elapsed


def time_prepare(count: int = 200) -> float:
    """p50 ms of the agent's cached path (the stack's cache, this process's settings)."""
    from types import SimpleNamespace

    from agent import envcache

    job = SimpleNamespace(pk=0, environment=None, requirements=REQUIREMENTS, python_version="")
    timings = []
    for _ in range(count):
        started = time.perf_counter()
        prepared = envcache.prepare(job, lambda text: None, lambda: True)
        timings.append((time.perf_counter() - started) * 1000)
        prepared.close()
    return percentile(timings, 50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 cached and 5 bare jobs instead of 20")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--no-ray", action="store_true", help="leave out the 2-node Ray job")
    args = parser.parse_args()
    count = args.jobs or (5 if args.quick else 20)

    data_dir = tempfile.mkdtemp(prefix="hangar-bench-envs-")
    os.environ["HANGAR_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from tests.livestack import LiveStack

    with LiveStack(data_dir=data_dir, env=UNSANDBOXED) as stack:
        bare = [sys.executable, "-c", FIRST_LINE]  # the interpreter the cached environment is built from
        cached = ["python", "-c", FIRST_LINE]  # its python: the cached environment's bin/ comes first on PATH
        for _ in range(2):  # warm up: imports, connections
            time_start(stack, bare)
        build_ms, first = time_start(stack, cached, requirements=REQUIREMENTS)
        if first["state"] != "succeeded":
            raise SystemExit(f"the first job with requirements failed: {first['state_reason']}")
        timings: dict[str, list[float]] = {"cached": [], "bare": []}
        for _ in range(count):
            timings["cached"].append(time_start(stack, cached, requirements=REQUIREMENTS)[0])
            timings["bare"].append(time_start(stack, bare)[0])
        record = stack.job(first["id"])["attempts"][0]["environment"]
        prepare_ms = time_prepare()
        ray_first = ray_cached = None
        if not args.no_ray:
            stack.start_agent("node-b", gpus=1)
            ray_first, ray_cached = time_ray_driver(stack), time_ray_driver(stack)

    cached_p50, bare_p50 = percentile(timings["cached"], 50), percentile(timings["bare"], 50)
    print(f"environment {record['hash'][:12]}: {', '.join(record['packages'])} ({record['python']})")
    print(f"first start (resolve + build with uv): {build_ms / 1000:.2f} s (build alone {record['build_seconds']} s)")
    for name, values in timings.items():
        print(f"{name}: submit -> first line, {count} jobs: p50 {percentile(values, 50):.1f} ms, "
              f"p95 {percentile(values, 95):.1f} ms")  # fmt: skip
    print(f"the agent's cached path alone (envcache.prepare, a hit): p50 {prepare_ms:.2f} ms")
    ray = ""
    if ray_cached is not None:
        print(f"Ray on 2 nodes, submit -> driver start: {ray_first:.1f} s with the Ray environment's build, "
              f"{ray_cached:.1f} s with it cached")  # fmt: skip
        ray = f" ray_first_driver_start_s={ray_first:.1f} ray_driver_start_s={ray_cached:.1f}"
    print(
        f"jobs={count} build_s={build_ms / 1000:.2f} cached_start_ms={cached_p50:.1f} bare_start_ms={bare_p50:.1f} "
        f"cached_extra_ms={cached_p50 - bare_p50:.1f} prepare_cached_ms={prepare_ms:.2f}{ray}"
    )


if __name__ == "__main__":
    main()
