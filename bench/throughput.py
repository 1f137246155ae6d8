"""Short jobs back to back: how much of the fleet's time do they keep busy?

Starts a whole Hangar (`manage.py up` without its local agent) in a temporary data
directory and N agents of G simulated GPUs each, submits J jobs of `sleep D` (1 GPU
each) at once, waits for all of them, and reads the attempts' own timings:

- makespan (from the release), jobs/s, and efficiency = ideal makespan (J x D / GPUs) / measured;
- the hand-off gap per GPU: from an attempt's end being recorded to the next
  attempt's process starting on the same GPU (p50/p99/max; only while jobs waited),
  and apart, those after the release's first BURST_SECONDS: at first every GPU's job
  starts at once and ends at once, and that burst makes most of the p99; and the longest 1 %
  in stages (placed after the end, taken by the agent, preflight), with when they began;
- from the fleet's release (every job queued first: the nodes are cordoned while they are
  submitted) to the process's start, p50/p99;
- CPU seconds per job of the scheduler, the agents, the web server and the database.

Then the same with `echo` jobs (duration ~0), reported as jobs/s (`--echo-jobs 0`: none; the last line then says nan).

    python bench/throughput.py [--quick] [--agents N] [--gpus G] [--jobs J] [--duration D] [--echo-jobs K]

Embedded default unless DATABASE_URL / CELERY_BROKER_URL / REDIS_URL are set.
Last line: mode=... jobs=... gpus=... makespan_s=... efficiency=... handoff_p50_ms=... handoff_p99_ms=...
handoff_p99_after_burst_ms=... echo_jobs_per_s=... isolation=... (sandbox: as root with bubblewrap, as the
figures in the README were taken).
"""

import argparse
import os
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TICKS = os.sysconf("SC_CLK_TCK")
STAGES = ("placed", "taken", "preflight", "run+record")
BURST_SECONDS = 5.0  # after the release: the hand-offs of the jobs that all started at once


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def millis(delta) -> float:
    return delta.total_seconds() * 1000


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children that were waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / TICKS  # utime, stime, cutime, cstime


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process on the machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(entry.name)] = (ppid, cmdline)
    return out


def roles(stack, services: bool) -> dict[str, list[int]]:
    """The stack's processes by role: web, scheduler, notifier, agents (database: PostgreSQL's backends, by name)."""
    table = processes()
    children = defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    found = defaultdict(list)
    for pid in children[stack.proc.pid]:
        cmd = table[pid][1]
        role = "web" if "portal.webserver" in cmd else "scheduler" if "scheduler" in cmd else "other"
        found["notifier" if "notifier" in cmd else role].append(pid)  # it updates the jobs' MLflow runs
    found["agents"] = [proc.pid for proc in stack.agents.values()]
    if services:  # PostgreSQL's backends (any on this machine: run the bench on a quiet one)
        found["database"] = [pid for pid, (_, cmd) in table.items() if cmd.startswith("postgres:")]
    return found


def cpu_by_role(pids: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(cpu_seconds(pid) for pid in group) for role, group in pids.items()}


def submit_all(stack, count: int, command: list[str]) -> list[int]:
    def one(index: int) -> int:
        return stack.submit(command, name=f"short-{index}", gpus_per_node=1, max_runtime_seconds=600)["id"]

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(one, range(count)))


def wait_all(job_ids: list[int], timeout: float) -> None:
    """Until every job has ended and every attempt's end is settled (jobs/settling.py: a
    moment later, in the notifier), so the CPU read after counts all a job made."""
    from jobs.models import FINAL_JOB_STATES, Attempt, Job

    # The bench shares the cores with the stack it measures: its poll must cost little (an IN of
    # 1,000 ids every 0.2 s was ~5 % of a core, with PostgreSQL's share). The jobs were submitted
    # together, so their ids are one range unless something else submitted meanwhile.
    jobs = Job.objects.filter(pk__range=(min(job_ids), max(job_ids)))
    if jobs.count() != len(job_ids):
        jobs = Job.objects.filter(pk__in=job_ids)
    deadline = time.monotonic() + timeout
    while jobs.exclude(state__in=FINAL_JOB_STATES).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"not every job ended within {timeout:.0f}s")
        time.sleep(0.5)
    unsettled = Attempt.objects.filter(job__in=jobs, priced_at=None)
    while unsettled.exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def hold_fleet(hold: bool) -> None:
    """Cordon every node (no job starts), or uncordon them all in one transaction (one pass)."""
    from django.db import transaction

    from fleet.models import Node

    with transaction.atomic():
        for node in Node.objects.all():
            if hold:
                node.cordon(None, "bench/throughput.py: the jobs queue up first")
            else:
                node.uncordon(None, "bench/throughput.py: every job is queued")


def measure(stack, count: int, command: list[str], duration: float, gpus: int) -> dict:
    from django.conf import settings

    from jobs.models import Attempt, Job

    pids = roles(stack, services=not settings.EMBEDDED_DATABASE)
    cpu_before = cpu_by_role(pids)
    # Every job is queued before the fleet may take one: cordoned while they are submitted
    # (the web takes them at its own pace, ~15-20/s on two cores), then uncordoned at once.
    hold_fleet(True)
    submit_started = time.time()
    job_ids = submit_all(stack, count, command)
    submitted = time.time() - submit_started
    started = time.time()
    hold_fleet(False)
    released = datetime.fromtimestamp(started, tz=UTC)
    wait_all(job_ids, timeout=max(120.0, 20 * count * max(duration, 0.05) / gpus))
    cpu = {role: spent - cpu_before[role] for role, spent in cpu_by_role(pids).items()}
    # Processes started meanwhile spent all their CPU on this run: PostgreSQL's backends for the
    # connections the pools opened under load (counting only those alive at the start read
    # about half of the database's CPU).
    for role, group in roles(stack, services=not settings.EMBEDDED_DATABASE).items():
        cpu[role] = cpu.get(role, 0.0) + sum(cpu_seconds(pid) for pid in set(group) - set(pids.get(role, ())))
    jobs = {j.pk: j for j in Job.objects.filter(pk__in=job_ids)}
    attempts = list(Attempt.objects.filter(job_id__in=job_ids).select_related("node"))
    finished = max(a.finished_at for a in attempts).timestamp()
    makespan = finished - started

    by_gpu = defaultdict(list)
    for a in attempts:
        for rank in a.ranks:
            for gpu in rank["gpus"]:
                by_gpu[(rank["node_id"], gpu)].append(a)
    queued_until = max(a.running_at for a in attempts if a.running_at)  # jobs waited until the last one started
    # Each GPU's attempts in turn: the hand-off gaps (while jobs waited), and when each attempt's
    # GPUs were all freed (the end of the latest attempt before it on any of them).
    gaps, after_burst, handed, freed = [], [], [], {}
    for runs in by_gpu.values():
        runs = sorted((a for a in runs if a.running_at and a.finished_at), key=lambda a: a.running_at)
        for before, after in zip(runs, runs[1:], strict=False):
            freed[after.pk] = max(freed.get(after.pk, before.finished_at), before.finished_at)
            if after.running_at <= queued_until:
                gaps.append(millis(after.running_at - before.finished_at))
                ended = millis(before.finished_at - released)
                if ended >= BURST_SECONDS * 1000:
                    after_burst.append(gaps[-1])
                handed.append((gaps[-1], ended, after.pk))
    # From the fleet's release: every job was queued by then.
    starts = [millis(a.running_at - released) for a in attempts if a.running_at is not None]
    # Where an attempt's time goes, stage by stage (ms): placed after the GPU it took was freed
    # (or after the release), picked up by its agent, preflight, and from the process's start to its end recorded.
    stages, stages_of = defaultdict(list), {}
    for a in attempts:
        if not (a.started_at and a.running_at and a.finished_at):
            continue
        ready = max(freed.get(a.pk, released), released)
        stages_of[a.pk] = (
            millis(a.scheduled_at - ready),
            millis(a.started_at - a.scheduled_at),
            millis(a.running_at - a.started_at),
            millis(a.finished_at - a.running_at),
        )
        for name, ms in zip(STAGES, stages_of[a.pk], strict=True):
            stages[name].append(ms)
    # The longest 1 % of the hand-offs: the gap, when the attempt before it ended, and the stages of the one after.
    longest = [
        (gap, ended, *stages_of[pk][:3])
        for gap, ended, pk in sorted(handed, reverse=True)[: max(1, len(handed) // 100)]
        if pk in stages_of
    ]
    return {
        "makespan_s": makespan,
        "submit_s": submitted,
        "submit_rate": count / submitted,
        "jobs_per_s": count / makespan,
        "efficiency": (count * duration / gpus) / makespan if duration else float("nan"),
        "gaps": gaps,
        "gaps_after_burst": after_burst,
        "longest_gaps": longest,
        "starts": starts,
        "attempts": len(attempts),
        "succeeded": sum(1 for j in jobs.values() if j.state == "succeeded"),
        "cpu_per_job_ms": {role: spent * 1000 / count for role, spent in cpu.items() if role != "other"},
        "stages": stages,
        # Attempts that did not end their job: why each was run again (a job should need one).
        # Jobs whose MLflow run could not be made or updated (the job ran; its page says why).
        "tracking_errors": Counter(j.tracking_error[:100] for j in jobs.values() if j.tracking_error),
        "rerun": Counter(f"{a.state}: {a.reason[:80]}" for a in attempts if a.state != jobs[a.job_id].state),
    }


def report(label: str, result: dict) -> None:
    gaps, starts = result["gaps"], result["starts"]
    print(
        f"{label}: {result['succeeded']} succeeded in {result['attempts']} attempts, makespan "
        f"{result['makespan_s']:.1f} s, {result['jobs_per_s']:.1f} jobs/s, efficiency {result['efficiency']:.2f} "
        f"(queued first: submitted in {result['submit_s']:.1f} s, {result['submit_rate']:.0f}/s)"
    )
    print(
        f"  hand-off gap ({len(gaps)}): p50 {percentile(gaps, 50):.0f} ms, p99 {percentile(gaps, 99):.0f} ms, "
        f"max {max(gaps, default=float('nan')):.0f} ms; release -> start p50 {percentile(starts, 50):.0f} ms, "
        f"p99 {percentile(starts, 99):.0f} ms"
    )
    if later := result["gaps_after_burst"]:
        print(
            f"  hand-off gap after the release's first {BURST_SECONDS:g} s ({len(later)}): "
            f"p50 {percentile(later, 50):.0f} ms, p99 {percentile(later, 99):.0f} ms"
        )
    if longest := result["longest_gaps"]:
        mean = [sum(column) / len(longest) for column in zip(*longest, strict=True)]
        print(
            f"  the {len(longest)} longest hand-offs (1 %), mean ms: gap {mean[0]:.0f}, its end {mean[1]:.0f} after "
            f"the release; placed {mean[2]:.0f}, taken {mean[3]:.0f}, preflight {mean[4]:.0f}"
        )
    stages = ", ".join(
        f"{name} {percentile(values, 50):.0f}/{percentile(values, 99):.0f}" for name, values in result["stages"].items()
    )
    print(f"  stages p50/p99 ms: {stages}")
    cpu = ", ".join(f"{role} {ms:.1f}" for role, ms in result["cpu_per_job_ms"].items())
    print(f"  CPU ms per job: {cpu}")
    for why, times in result["tracking_errors"].most_common(3):
        print(f"  MLflow failed for {times} jobs: {why}")
    for why, times in result["rerun"].most_common(5):
        print(f"  run again {times}x after an attempt {why}")


def isolation(data_dir: str, agent: str) -> str:
    """How the agent isolates jobs, as it said at its start: `sandbox`, `uid` (bubblewrap
    missing: no namespaces, so a start costs less) or `none` (not root)."""
    log = (Path(data_dir) / f"agent-{agent}.log").read_text(errors="replace")
    found = re.search(r"isolation: (\w+)", log)
    return found.group(1) if found else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 jobs on 2 agents x 4 GPUs")
    parser.add_argument("--agents", type=int)
    parser.add_argument("--gpus", type=int, help="GPUs per agent")
    parser.add_argument("--jobs", type=int)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds each job sleeps")
    parser.add_argument("--echo-jobs", type=int, help="echo jobs after the sleeping ones (0: none)")
    args = parser.parse_args()
    agents = args.agents or (2 if args.quick else 4)
    per_agent = args.gpus or (4 if args.quick else 8)
    count = args.jobs or (200 if args.quick else 1000)
    echoes = args.echo_jobs if args.echo_jobs is not None else (60 if args.quick else 200)

    data_dir = tempfile.mkdtemp(prefix="hangar-bench-")
    os.environ["HANGAR_DATA_DIR"] = data_dir
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    import django

    django.setup()
    from django.conf import settings

    from tests.livestack import LiveStack

    mode = "embedded" if settings.EMBEDDED_DATABASE else "services"
    gpus = agents * per_agent
    # The agents beat at the product's default (LiveStack's tests beat every second): a beat
    # samples and stores every GPU, and on two cores that CPU is taken from the jobs.
    heartbeat = os.environ.get("HANGAR_HEARTBEAT_SECONDS", "5")
    # 1,200 jobs submitted at once by one token pass its API rate limit (1200/min): this bench
    # times running them, not the limit (bench/api.py times submitting).
    env = {"HANGAR_HEARTBEAT_SECONDS": heartbeat, "HANGAR_API_RATE_LIMIT": "100000/min"}
    with LiveStack(data_dir=data_dir, local_agent=False, env=env) as stack:
        for index in range(agents):
            stack.start_agent(f"tp-{index}", gpus=per_agent)
        measure(stack, min(gpus, 8), ["true"], 0.0, gpus)  # warm up: imports, connections, MLflow's store
        isolated = isolation(data_dir, "tp-0")
        print(f"jobs' isolation: {isolated}" + (" (see agent/sandbox.py)" if isolated != "sandbox" else ""))
        sleeping = measure(stack, count, ["sleep", f"{args.duration:g}"], args.duration, gpus)
        report(f"{count} x sleep {args.duration:g} on {agents} x {per_agent} GPUs", sleeping)
        echo = {"jobs_per_s": float("nan")}  # --echo-jobs 0: the sleeping jobs alone
        if echoes:
            echo = measure(stack, echoes, ["echo", "hi"], 0.0, gpus)
            report(f"{echoes} x echo", echo)

    print(
        f"mode={mode} jobs={count} gpus={gpus} makespan_s={sleeping['makespan_s']:.1f} "
        f"efficiency={sleeping['efficiency']:.2f} handoff_p50_ms={percentile(sleeping['gaps'], 50):.0f} "
        f"handoff_p99_ms={percentile(sleeping['gaps'], 99):.0f} "
        f"handoff_p99_after_burst_ms={percentile(sleeping['gaps_after_burst'], 99):.0f} "
        f"start_p50_ms={percentile(sleeping['starts'], 50):.0f} "
        f"echo_jobs_per_s={echo['jobs_per_s']:.1f} isolation={isolated}"
    )


if __name__ == "__main__":
    main()
