"""A prepared check of what Hangar does with real NVIDIA GPUs, in under 5 minutes.

On a machine with NVIDIA GPUs (nvidia-ml-py finds them) it checks, in a throw-away data directory:

- the NVML provider: inventory (model, memory, UUID) and how long it takes;
- telemetry sampling: N samples of every GPU (utilisation, memory, temperature, power, clocks,
  throttle reasons, ECC counters, Xid events) and the time per sample;
- the preflight suite and the agent's re-check (agent/recheck.py) on live NVML data;
- the diagnosis of a real CUDA out-of-memory: a CUDA torch process allocates past the free memory
  of GPU 0, and jobs/diagnosis.py must call it cuda_oom with the tried/free figures;
- the burn-in stress (agent/stress.py): matrix multiplies on every GPU with CUDA torch.

Without NVIDIA GPUs it says so, runs the same steps on simulated GPUs (the OOM step is skipped)
and still exits 0, so CI runs it too.

    python bench/real_gpu.py [--quick] [--python PATH]

--python: an interpreter with CUDA torch (default: HANGAR_BURN_IN_PYTHON, then this one).
Last line: simulated=... gpus=... model=... inventory_ms=... sample_ms=... preflight=... recheck=...
cuda_oom=... stress=... seconds=... ok=...
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OOM = r"""
import torch
free, total = torch.cuda.mem_get_info(0)
print(f"free {free / 2**30:.2f} GiB of {total / 2**30:.2f} GiB", flush=True)
x = torch.empty(int(free * 1.5), dtype=torch.uint8, device="cuda:0")
"""


def setup() -> None:
    os.environ.setdefault("HANGAR_DATA_DIR", tempfile.mkdtemp(prefix="hangar-real-gpu-"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    os.environ.setdefault("HANGAR_MLFLOW", "0")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def timed(call):
    start = time.perf_counter()
    result = call()
    return result, (time.perf_counter() - start) * 1000


def cuda_oom(python: str | None) -> tuple[str, str]:
    """Run a real CUDA OOM and diagnose its output: (result, detail)."""
    from jobs.diagnosis import Ending, Line, diagnose

    if python is None:
        return "skipped", "no interpreter with CUDA torch"
    out = subprocess.run([python, "-c", OOM], capture_output=True, text=True, timeout=180)
    lines = [Line(i, text, stream="stderr") for i, text in enumerate(out.stderr.splitlines(), 1)]
    found = diagnose(lines, Ending(exit_code=out.returncode))
    detail = f"{found.category}: {found.summary} | hint: {found.hint}"
    ok = found.category == "cuda_oom" and "tried to allocate" in found.summary and "free" in found.summary
    return ("passed" if ok else "failed"), detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, a shorter stress")
    parser.add_argument("--python", help="an interpreter with CUDA torch")
    args = parser.parse_args()
    os.environ.setdefault("HANGAR_BURN_IN_STRESS_SECONDS", "2" if args.quick else "5")
    began = time.monotonic()
    setup()
    from agent import recheck, stress
    from agent.node import Agent
    from agent.preflight import live_context
    from fleet import gpus, preflight

    provider = gpus.detect_provider("real-gpu-check")
    print(f"provider: {type(provider).__name__} ({'SIMULATED: no NVIDIA GPU found' if provider.simulated else 'NVML'})")
    inventory, inventory_ms = timed(provider.inventory)
    for g in inventory:
        print(f"  GPU {g.index}: {g.model} {g.memory_total_mb} MiB {g.uuid}")
    indices = [g.index for g in inventory]
    sample_ms = []
    for _ in range(3 if args.quick else 10):
        samples, ms = timed(lambda: provider.sample(set(indices)))
        sample_ms.append(ms)
    for s in samples:
        print(f"  sample GPU {s.index}: util {s.utilization_pct}% mem {s.memory_used_mb} MiB {s.temperature_c}°C "
              f"{s.power_w} W sm {s.sm_clock_mhz} MHz throttle {list(s.throttle_reasons)} "
              f"ecc {s.ecc_uncorrected_volatile}/{s.ecc_uncorrected_aggregate} xids {list(s.xids)}")  # fmt: skip
    the_agent = Agent("real-gpu-check", provider, 1.0)
    node = the_agent.register()
    results = preflight.run_checks(live_context(node, indices, ""))
    for r in results:
        print(f"  preflight {r.name}: {'pass' if r.passed else 'FAIL'} ({r.duration_ms:.1f} ms) {r.evidence}")
    checked, failures = recheck.recheck(node, indices)
    print(f"  recheck: ran={checked} failures={failures}")
    python = None
    if not provider.simulated:
        candidates = [args.python or "", os.environ.get("HANGAR_BURN_IN_PYTHON", ""), sys.executable]
        python, tried = stress.torch_python([p for p in candidates if p and os.path.exists(p)])
        print(f"  CUDA torch: {python or 'none'} {tried}")
    oom, detail = cuda_oom(python)
    print(f"  cuda_oom diagnosis: {oom}: {detail}")
    passed, evidence = stress.run(provider, node, indices)
    print(f"  stress: {'pass' if passed else 'FAIL'}: {evidence}")
    preflight_ok = all(r.passed for r in results)
    ok = preflight_ok and not failures and passed and oom != "failed"
    print(
        f"simulated={'yes' if provider.simulated else 'no'} gpus={len(inventory)} "
        f"model={inventory[0].model if inventory else 'none'} inventory_ms={inventory_ms:.1f} "
        f"sample_ms={sum(sample_ms) / len(sample_ms):.1f} preflight={'passed' if preflight_ok else 'failed'} "
        f"recheck={'passed' if checked and not failures else 'failed'} cuda_oom={oom} "
        f"stress={'passed' if passed else 'failed'} seconds={time.monotonic() - began:.1f} ok={'yes' if ok else 'no'}"
    )
    return 0 if ok or provider.simulated else 1


if __name__ == "__main__":
    sys.exit(main())
