"""Run each script under scripts/ as a job would run it (its own working directory, torchrun-style
variables per rank, stdout and stderr read line by line) and store what it printed and how it
exited as <name>.json: the real outputs the diagnosis table tests read.

    python tests/diagnosis_cases/generate.py [name ...]
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORLD = {"gloo_peer_raises": 2, "gloo_timeout": 2, "gloo_abort_after_destroy": 2, "gloo_peer_vanishes": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(pipe, rank: int, stream: str, start: float, out: list, lock: threading.Lock) -> None:
    for raw in iter(pipe.readline, b""):
        with lock:
            out.append({"rank": rank, "stream": stream, "t": round(time.monotonic() - start, 3),
                        "text": raw.decode(errors="replace").rstrip("\n")})  # fmt: skip


def run(name: str) -> dict:
    world = WORLD.get(name, 1)
    workdir = Path(tempfile.mkdtemp(prefix="hangar-job-"))
    shutil.copy(HERE / "scripts" / f"{name}.py", workdir / "train.py")
    port, start, lines, lock = free_port(), time.monotonic(), [], threading.Lock()
    procs, readers = [], []
    for rank in range(world):
        env = {"PATH": os.environ["PATH"], "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": "0"}  # fmt: skip
        proc = subprocess.Popen([sys.executable, "train.py"], cwd=workdir, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        procs.append(proc)
        for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
            reader = threading.Thread(target=read, args=(pipe, rank, stream, start, lines, lock))
            reader.start()
            readers.append(reader)
    codes = {}
    for rank, proc in enumerate(procs):
        rc = proc.wait(timeout=120)
        codes[rank] = 128 - rc if rc < 0 else rc  # the shell's 128 + signal, as the agent records it
    for reader in readers:
        reader.join()
    shutil.rmtree(workdir)
    lines.sort(key=lambda line: line["t"])
    for seq, line in enumerate(lines, 1):
        line["seq"] = seq
    return {"name": name, "world_size": world, "workdir": str(workdir), "exit_codes": codes, "lines": lines,
            "generated_with": f"python {sys.version.split()[0]}, torch {torch_version()}"}  # fmt: skip


def torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True)
    return out.stdout.decode().strip() or "none"


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.stem for p in (HERE / "scripts").glob("*.py"))
    for name in names:
        case = run(name)
        (HERE / f"{name}.json").write_text(json.dumps(case, indent=1) + "\n")
        print(name, case["exit_codes"], len(case["lines"]), "lines")
