"""bench/real_gpu.py runs everywhere: on simulated GPUs it says so and exits 0 (CI runs it)."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "real_gpu.py"


def test_the_real_gpu_check_runs_on_simulated_gpus_and_says_so(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "HANGAR_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, env=env, timeout=300)

    assert done.returncode == 0, done.stdout + done.stderr
    last = dict(pair.split("=", 1) for pair in done.stdout.strip().splitlines()[-1].split())
    if last["simulated"] == "yes":
        assert "SIMULATED" in done.stdout and last["cuda_oom"] == "skipped"
    assert last["preflight"] == "passed" and last["recheck"] == "passed" and last["stress"] == "passed"
