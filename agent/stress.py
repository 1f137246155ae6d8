"""The burn-in's stress step: load every GPU of a node for a few seconds and watch it.

It runs in the node's agent process (where the GPUs are): on simulated GPUs it
loads the simulator and reads back what the injected faults do under load; on
NVML nodes it runs a few seconds of matrix multiplies on each GPU in a
subprocess, with an interpreter that has PyTorch with CUDA, when the node has
one; without one the step is skipped and says why.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.dispatch import receiver

from agent import running
from fleet import signals
from fleet.gpus import GpuProvider
from fleet.preflight import Result, record

# Each GPU: a deterministic matmul chain for SECONDS, checked against its first result
# (a GPU that computes wrong or not at all fails), with the rate it reached.
TORCH_STRESS = r"""
import sys, time, torch
seconds, indices = float(sys.argv[1]), [int(i) for i in sys.argv[2].split(",")]
for i in indices:
    dev = torch.device("cuda", i)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(4096, 4096, device=dev, generator=g)
    b = torch.randn(4096, 4096, device=dev, generator=g)
    ref = (a @ b).sum().item()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        c = a @ b
        n += 1
    total = c.sum().item()
    torch.cuda.synchronize(dev)
    rate = 2 * 4096**3 * n / (time.perf_counter() - start) / 1e12
    ok = abs(total - ref) <= 1e-3 * max(1.0, abs(ref))
    print(f"GPU {i}: {n} matmuls, {rate:.1f} TFLOP/s, {'consistent' if ok else f'MISMATCH {total} != {ref}'}")
    if not ok:
        sys.exit(3)
"""

PROBE = "import torch; print(torch.cuda.device_count())"


def stress_seconds() -> float:
    return settings.HANGAR_BURN_IN_STRESS_SECONDS


def simulated(provider: GpuProvider, indices: list[int], seconds: float) -> tuple[bool, str]:
    """Load the simulated GPUs and fail on what an injected fault makes them show under load."""
    deadline, seen, samples = time.monotonic() + seconds, {}, 0
    while True:
        for s in provider.sample(set(indices), events=False):  # Xids stay for the heartbeat to record
            if s.index not in indices:
                continue
            problems = seen.setdefault(s.index, set())
            if s.lost:
                problems.add("fell off the bus")
            elif s.ecc_uncorrected_volatile:
                problems.add(f"{s.ecc_uncorrected_volatile} uncorrectable ECC errors")
            if s.xids:
                problems.add("Xid " + ",".join(map(str, s.xids)))
            if s.thermal_throttled or s.power_throttled:
                problems.add("throttled under load: " + "+".join(s.throttle_reasons))
        samples += 1
        if time.monotonic() >= deadline:
            break
        time.sleep(min(0.25, seconds))
    bad = {i: sorted(p) for i, p in seen.items() if p}
    if bad:
        return False, "simulated stress: " + "; ".join(f"GPU {i} {', '.join(p)}" for i, p in sorted(bad.items()))
    return True, f"simulated stress: GPUs {sorted(seen)} loaded for {seconds:g}s ({samples} samples), no fault"


def torch_python(candidates: list[str]) -> tuple[str | None, str]:
    """The first interpreter that imports torch and sees CUDA devices, and what was tried."""
    tried = []
    for python in dict.fromkeys(candidates):
        try:
            out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            tried.append(f"{python}: {type(exc).__name__}")
            continue
        count = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
        if count and count[0].isdigit():
            if int(count[0]) > 0:
                return python, ""
            tried.append(f"{python}: torch sees no CUDA device")
        else:
            tried.append(f"{python}: " + ((out.stderr.strip().splitlines() or ["no answer"])[-1])[:200])
    return None, "; ".join(tried)


def interpreters(node) -> list[str]:
    """Where torch may be: the configured one, the node's host environments, the agent's own."""
    found = [settings.HANGAR_BURN_IN_PYTHON]
    for env in node.environments.filter(kind="host").exclude(path=""):
        found.append(str(Path(env.path) / "bin" / "python"))
    found.append(sys.executable)
    return [p for p in found if p and os.path.exists(p)]


def with_torch(node, indices: list[int], seconds: float) -> tuple[bool, str]:
    python, tried = torch_python(interpreters(node))
    if python is None:
        return True, f"skipped: no interpreter with PyTorch and CUDA on this node ({tried})"
    argv = [python, "-c", TORCH_STRESS, str(seconds), ",".join(map(str, indices))]
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=seconds * len(indices) + 120)
    except subprocess.TimeoutExpired:
        return False, f"matmul stress with {python} did not finish in time"
    text = (out.stdout.strip() + "\n" + out.stderr.strip()[-800:]).strip()
    return out.returncode == 0, f"matmul stress with {python} (exit {out.returncode}): {text}"


def run(provider: GpuProvider, node, indices: list[int]) -> tuple[bool, str]:
    seconds = stress_seconds()
    if provider.simulated:
        return simulated(provider, indices, seconds)
    return with_torch(node, indices, seconds)


@receiver(signals.stress_here)
def _stress_in_this_process(sender, node_id: int, **kwargs) -> Result | None:
    return stress_here(node_id)


def stress_here(node_id: int) -> Result | None:
    """Run and record the stress step, if this process is the node's agent (else None)."""
    current = running.CURRENT
    if current is None or current.node is None or current.node.pk != node_id:
        return None
    node = current.node
    indices = sorted(node.gpus.values_list("index", flat=True))
    start = time.perf_counter()
    try:
        passed, evidence = run(current.provider, node, indices)
    except Exception as exc:  # a driver or subprocess failure is the step's evidence
        passed, evidence = False, f"the stress step failed to run: {type(exc).__name__}: {exc}"
    result = Result("stress", passed, evidence, (time.perf_counter() - start) * 1000)
    record(node, [result], "burn-in")
    return result
