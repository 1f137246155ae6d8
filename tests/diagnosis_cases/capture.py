"""Run small programs that fail the ways training jobs fail, as a job runs (its own working
directory, torchrun-style variables per rank when it has several, stdout and stderr read line by
line), and store what each printed and how each rank exited as <name>.json: the real outputs the
diagnosis table (tests/test_diagnosis.py) reads. Nothing in a case file is written by hand but its
expectation (`expect`), which comes from the table below.

    python tests/diagnosis_cases/capture.py [name ...]     # as root: some cases need it
    python tests/diagnosis_cases/capture.py --expectations # rewrite only each file's `expect`

Cases run as root unless `sandbox` (then as a job uid inside bubblewrap, as agent/sandbox.py runs
a job). Some need the machine: a 64 KiB tmpfs (a full disk), a 64 MiB memory cgroup (the
kernel's OOM killer), gcc (a program whose shared library is gone), numpy (pip installs it into a
throwaway folder for that case only).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = "{python}"  # the interpreter; recorded as `python` in the case's command
JOB_UID = 200977  # a uid no one else uses here: the sandboxed cases run as it
CG_LIMIT = 64 * 1024 * 1024


@dataclass(frozen=True)
class Case:
    name: str
    category: str  # what the diagnosis must say
    rank: int | None = 0  # the first failing rank it must name (None: none)
    summary: str = ""  # a phrase the summary must hold
    hint: str = ""  # and one the hint must
    command: tuple[str, ...] = (PY, "train.py")
    script: str | None = ""  # the job's train.py is scripts/<script or name>.py; None: it has none
    files: dict = field(default_factory=dict)  # the job's other files: relative path -> text
    world: int = 1
    sandbox: bool = False
    path: str = ""  # the job's PATH, when not the venv's bin and the system's
    setup: tuple[str, ...] = ()  # tmpfs | cgroup | numpy | shared_lib
    send: tuple[int, str] | None = None  # a signal, sent to the job's process group after a line holding this
    chdir: str = ""  # a working directory below the job's that does not exist
    failure_class: str = "user"  # as the agent records the ending today


CONFIGURATOR = """\
# nanoGPT's configurator.py (poor man's configurator), shortened: a config file named on the
# command line is exec'd, then --key=value overrides.
import sys
from ast import literal_eval

for arg in sys.argv[1:]:
    if '=' not in arg:
        assert not arg.startswith('--')
        config_file = arg
        print(f"Overriding config with {config_file}:")
        with open(config_file) as f:
            print(f.read())
        exec(open(config_file).read())
    else:
        key, val = arg.split('=')
        key = key[2:]
        if key in globals():
            try:
                attempt = literal_eval(val)
            except (SyntaxError, ValueError):
                attempt = val
            print(f"Overriding: {key} = {attempt}")
            globals()[key] = attempt
        else:
            raise ValueError(f"Unknown config key: {key}")
"""
NANO_CONFIG_NAMEERROR = """\
# train a miniature character-level shakespeare model
out_dir = 'out-shakespeare-char'
eval_interval = 250
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256
n_layer = 6
dropout = 0.2
learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = max_iters
min_lr = learning_rate / 10
beta2 = 0.99
warmup_iters = warmup_ratio * max_iters
"""
NANO_CONFIG_SYNTAX = """\
out_dir = 'out-shakespeare-char'
batch_size = 64
learning_rate = 1e-3,
dropout = 0.2
init_from = 'scratch
"""
SYNTAX_NAN = """\
# A typo on a line that mentions nan: Python echoes the line in its error.
from math import nan

step = 0
loss = nan if step == 0 els 1.0
print("loss", loss)
"""
INDENTATION = """\
# Mixed indentation after an edit.
def train(steps):
    for step in range(steps):
        loss = 1.0 / (step + 1)
      print(step, loss)


train(3)
"""
MISSING_LIB_C = "int hangar_demo(void);\nint main(void) { return hangar_demo(); }\n"

CASES = [
    # --- captured before, kept (their scripts under scripts/) ------------------------------
    Case("host_oom_rlimit", "host_oom", 0, "tried to allocate 4.00 GiB", "host (CPU) memory"),
    Case("host_oom_memoryerror", "host_oom", 0, "host memory exhausted", "host (CPU) memory"),
    Case("nan_loss", "nan_loss", 0, "loss", "learning rate"),
    Case("nan_anomaly", "nan_loss", 0, "returned nan values", "clip gradients"),
    Case("module_not_found", "import_error", 0, "No module named 'transformerz'", "'transformerz' is not installed"),
    Case("file_not_found", "file_not_found", 0, "data/train.csv", "working directory"),
    Case("permission_denied", "permission", 0, "Permission denied: '/root/.hangar-not-yours'", "may not read"),
    Case("deep_torch", "python_exception", 0, "train.py:12 in forward", "mat1 and mat2 shapes"),
    Case("segfault", "segfault", None, "SIGSEGV", "PYTHONFAULTHANDLER"),
    Case("segfault_faulthandler", "segfault", 0, "Segmentation fault", "PYTHONFAULTHANDLER"),
    Case("gloo_peer_raises", "python_exception", 1, "KeyError: 'batch_size' (train.py:13 in <module>)", "KeyError",
         world=2),  # fmt: skip
    Case("gloo_peer_vanishes", "network_error", 1, "rank 1 exited with code 1 first", "another rank failed first",
         world=2),  # fmt: skip
    Case("gloo_timeout", "collective_timeout", 0, "Timed out waiting 3000ms", "same collectives", world=2),
    Case("gloo_abort_after_destroy", "abort", 1, "aborted at exit after its last output", "dist.barrier()", world=2),
    # --- Python's own errors -----------------------------------------------------------------
    Case("syntax_error_nan", "syntax_error", 0, "train.py:5", "Fix the syntax", script=None,
         files={"train.py": SYNTAX_NAN}),
    Case("syntax_error_in_module", "syntax_error", 0, "model.py:3", "model.py",
         files={"model.py": "def build(width):\n    layers = [width] * 4\n    return layers[0 if width else nan]]\n"}),
    Case("indentation_error", "syntax_error", 0, "IndentationError", "train.py:5", script=None,
         files={"train.py": INDENTATION}),
    Case("nanogpt_config_nameerror", "python_exception", 0, "config/train_shakespeare_char.py:14",
         "warmup_ratio", command=(PY, "train.py", "config/train_shakespeare_char.py", "--device=cpu"),
         script="nanogpt_train",
         files={"configurator.py": CONFIGURATOR, "config/train_shakespeare_char.py": NANO_CONFIG_NAMEERROR}),
    Case("nanogpt_config_syntax", "syntax_error", 0, "config/train_shakespeare_char.py:5", "init_from = 'scratch",
         command=(PY, "train.py", "config/train_shakespeare_char.py"), script="nanogpt_train",
         files={"configurator.py": CONFIGURATOR, "config/train_shakespeare_char.py": NANO_CONFIG_SYNTAX}),
    Case("nanogpt_unknown_key", "python_exception", 0, "Unknown config key: lr", "configurator.py",
         command=(PY, "train.py", "--lr=0.1"), script="nanogpt_train", files={"configurator.py": CONFIGURATOR}),
    Case("zero_division", "python_exception", 0, "ZeroDivisionError", "train.py:3 in mean"),
    Case("assertion_error", "python_exception", 0, "AssertionError", "train.py:6"),
    Case("recursion_error", "python_exception", 0, "RecursionError", "recursion"),
    Case("json_config_error", "python_exception", 0, "JSONDecodeError", "config.json",
         command=(PY, "train.py", "--config", "config.json"), files={"config.json": '{"lr": 0.1,\n "batch": 32,\n}\n'}),
    Case("key_error", "python_exception", 0, "KeyError: 'lr'", "train.py:5"),
    Case("type_error", "python_exception", 0, "TypeError", "train.py:3 in schedule"),
    Case("import_error_name", "import_error", 0, "cannot import name 'load_datasett'", "fix the name"),
    Case("nan_printed_then_keyerror", "python_exception", 0, "KeyError: 'val_loss'", "train.py:11"),
    Case("nan_loss_torch", "nan_loss", 0, "loss is nan at iter 0", "learning rate"),
    Case("value_error_nan_word", "python_exception", 0, "ValueError: unknown scheduler 'nanny'", "scheduler"),
    Case("keywords_in_source", "python_exception", 0, "ValueError: unclassified: timed out in step 3", "train.py:4"),
    Case("other_program_missing", "python_exception", 0, "KeyError: 'max_steps'", "train.py:9"),
    Case("log_lines_then_exit", "unknown", 0, "exited with code 3; no known error", "Nothing in the output"),
    # --- host memory ---------------------------------------------------------------------------
    Case("numpy_array_memory", "host_oom", 0, "Unable to allocate", "host (CPU) memory", setup=("numpy",)),
    Case("oom_killer", "host_oom", None, "SIGKILL", "host (CPU) memory", setup=("cgroup",)),
    Case("dataloader_worker_killed", "host_oom", 0, "DataLoader worker", "num_workers", setup=("cgroup",)),
    Case("gloo_rank_oom_killed", "host_oom", 1, "rank 1", "host (CPU) memory", world=2, setup=("cgroup",)),
    # --- the disk --------------------------------------------------------------------------------
    Case("disk_full_write", "disk_full", 0, "No space left on device", "disk", setup=("tmpfs",)),
    Case("disk_full_torch_save", "disk_full", 0, "unexpected pos", "disk", setup=("tmpfs",)),
    Case("disk_full_shell", "disk_full", 0, "No space left on device", "disk", script=None, setup=("tmpfs",),
         command=("bash", "-c", "echo saving && head -c 1000000 /dev/zero > out/ckpt.bin && echo done")),
    # --- signals the job handled, its own exits ----------------------------------------------------
    Case("sigterm_default", "interrupted", None, "SIGTERM", "SIGTERM", send=(signal.SIGTERM, "step 3")),
    Case("sigterm_handled", "interrupted", 0, "signal 15", "SIGTERM", send=(signal.SIGTERM, "step 3")),
    Case("keyboard_interrupt", "interrupted", 0, "KeyboardInterrupt", "SIGINT", send=(signal.SIGINT, "step 3")),
    Case("torchrun_sigterm", "interrupted", 0, "death signal", "SIGTERM", send=(signal.SIGTERM, "step 3"),
         command=(PY, "-m", "torch.distributed.run", "--nproc_per_node=1", "train.py")),
    Case("sys_exit_message", "script_exit", 0, "no checkpoint found in out/", "no checkpoint found"),
    Case("argparse_missing", "usage_error", 0, "the following arguments are required: --data", "--data"),
    Case("argparse_bad_choice", "usage_error", 0, "invalid choice: 'adamw8'", "--optim",
         command=(PY, "train.py", "--optim", "adamw8")),
    Case("abort_single", "abort", None, "SIGABRT", "SIGABRT"),
    # --- the environment: the launch, the interpreter, the libraries --------------------------------
    Case("env_bwrap_execvp_missing", "environment", 0, "/nonexistent/.venv/bin/python", "interpreter", script=None,
         sandbox=True, command=("/nonexistent/.venv/bin/python", "train.py")),
    Case("env_interpreter_under_root", "environment", 0, "Permission denied", "job's uid", sandbox=True,
         command=(PY, "train.py"), script="never_runs"),
    Case("env_python_on_pyenv_path", "environment", 0, "execvp python: Permission denied", "PATH", sandbox=True,
         command=("python", "train.py"), script="never_runs", path="/root/.pyenv/shims:/usr/local/bin:/usr/bin:/bin"),
    Case("env_command_not_found", "environment", 0, "python: command not found", "python", sandbox=True,
         command=("bash", "-c", "python train.py"), script="never_runs", path="/usr/local/bin:/usr/bin:/bin"),
    Case("env_missing_workdir", "environment", 0, "Can't chdir", "working directory", sandbox=True,
         command=("python3", "train.py"), script="never_runs", chdir="gone", path="/usr/bin:/bin"),
    Case("env_torch_no_cuda", "environment", 0, "Torch not compiled with CUDA enabled", "CUDA build"),
    Case("env_shared_library", "environment", 0, "libhangar_demo.so", "shared library", script=None,
         command=("./app",), setup=("shared_lib",)),
    Case("env_ctypes_library", "environment", 0, "libcudart.so.99", "shared library"),
    Case("env_pip_no_match", "environment", 0, "satisfies the requirement nonexistent-package-hangar",
         "requirements", script=None,
         command=(PY, "-m", "pip", "install", "--no-index", "--target", "deps", "nonexistent-package-hangar")),
    Case("env_uv_unsatisfiable", "environment", 0, "No solution found", "requirements", script=None,
         command=("uv", "pip", "install", "--offline", "--target", "deps", "torch==9.9.9")),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Output:
    """Every rank's lines in the order they were read, and a signal sent once a marker line shows."""

    def __init__(self, case: Case):
        self.case, self.start, self.lines, self.lock, self.sent = case, time.monotonic(), [], threading.Lock(), False
        self.groups: list[int] = []

    def read(self, pipe, rank: int, stream: str) -> None:
        for raw in iter(pipe.readline, b""):
            text = raw.decode(errors="replace").rstrip("\n")
            with self.lock:
                self.lines.append({"rank": rank, "stream": stream, "t": self.now(), "text": text})
                if self.case.send and not self.sent and self.case.send[1] in text:
                    self.sent = True
                    os.killpg(self.groups[rank], self.case.send[0])

    def now(self) -> float:
        return round(time.monotonic() - self.start, 4)


def prepare(case: Case, workdir: Path, scratch: Path) -> dict[str, str]:
    """The job's files and what the case's setup needs; the variables it adds."""
    if (script := script_of(case)) is not None:
        shutil.copy(script, workdir / "train.py")
    for name, text in case.files.items():
        (workdir / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / name).write_text(text)
    env = {}
    if "tmpfs" in case.setup:
        (workdir / "out").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(workdir / "out")], check=True)
    if "cgroup" in case.setup:
        env["DIAG_OOM_CGROUP"] = str(memory_cgroup(case.name))
    if "numpy" in case.setup:
        target = scratch / "numpy"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target), "numpy"], check=True)
        env["PYTHONPATH"] = str(target)
    if "shared_lib" in case.setup:
        (workdir / "lib.c").write_text("int hangar_demo(void) { return 0; }\n")
        (workdir / "main.c").write_text(MISSING_LIB_C)
        cc = ["gcc", "-shared", "-fPIC", "-o", "libhangar_demo.so", "lib.c"]
        subprocess.run(cc, cwd=workdir, check=True)
        subprocess.run(["gcc", "-o", "app", "main.c", "-L.", "-lhangar_demo"], cwd=workdir, check=True)
        for name in ("libhangar_demo.so", "lib.c", "main.c"):
            (workdir / name).unlink()
    if case.sandbox:
        for path in [workdir, *workdir.rglob("*")]:
            os.chown(path, JOB_UID, JOB_UID)
    return env


def script_of(case: Case) -> Path | None:
    return None if case.script is None else HERE / "scripts" / f"{case.script or case.name}.py"


def expectation(case: Case) -> dict:
    """What the diagnosis must say of the case (its file's `expect`)."""
    return {"category": case.category, "rank": case.rank, "summary": case.summary, "hint": case.hint}


def memory_cgroup(name: str) -> Path:
    """A memory cgroup (v1, below this process's own) of 64 MiB: a process that moves itself there
    and allocates past it is killed by the kernel's OOM killer, as on a node short of memory."""
    own = next(x.split(":", 2)[2] for x in Path("/proc/self/cgroup").read_text().splitlines() if ":memory:" in x)
    path = Path("/sys/fs/cgroup/memory" + own.rstrip("/")) / f"hangar-diag-{name}"
    path.mkdir(exist_ok=True)
    (path / "memory.limit_in_bytes").write_text(str(CG_LIMIT))
    return path


def clean_up(case: Case, workdir: Path, env: dict) -> None:
    if "tmpfs" in case.setup:
        subprocess.run(["umount", str(workdir / "out")], check=True)
    if "DIAG_OOM_CGROUP" in env:
        for _ in range(50):  # its last process may take a moment to leave
            try:
                Path(env["DIAG_OOM_CGROUP"]).rmdir()
                break
            except OSError:
                time.sleep(0.1)
    shutil.rmtree(workdir)


def argv_of(case: Case, workdir: Path) -> list[str]:
    argv = [sys.executable if part == PY else part for part in case.command]
    if not case.sandbox:
        return argv
    chdir = workdir / case.chdir if case.chdir else workdir
    return [
        "setpriv", f"--reuid={JOB_UID}", f"--regid={JOB_UID}", "--clear-groups", "--no-new-privs", "--",
        "bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-net", "--die-with-parent",
        "--new-session", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--bind", str(workdir), str(workdir), "--chdir", str(chdir), "--", *argv,
    ]  # fmt: skip


def run(case: Case) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="hangar-capture-"))
    workdir = Path(tempfile.mkdtemp(prefix="hangar-job-"))
    extra = prepare(case, workdir, scratch)
    port, out, procs, readers, exits = free_port(), Output(case), [], [], {}
    path = case.path or f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    try:
        for rank in range(case.world):
            env = {"PATH": path, "PYTHONUNBUFFERED": "1", "HOME": str(workdir), **extra}
            if case.world > 1:
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(case.world),
                           RANK=str(rank), LOCAL_RANK="0")  # fmt: skip
            proc = subprocess.Popen(argv_of(case, workdir), cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    preexec_fn=default_sigint)  # fmt: skip
            procs.append(proc)
            out.groups.append(proc.pid)
            for pipe, stream in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                reader = threading.Thread(target=out.read, args=(pipe, rank, stream))
                reader.start()
                readers.append(reader)
            waiter = threading.Thread(target=wait, args=(proc, rank, out, exits))
            waiter.start()
            readers.append(waiter)
        for thread in readers:
            thread.join(timeout=180)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        clean_up(case, workdir, extra)
        shutil.rmtree(scratch, ignore_errors=True)
    return record(case, workdir, out, exits)


def default_sigint() -> None:
    """A capture started in the background (`capture.py &`) inherits SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler: a job's process starts with it at its default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait(proc: subprocess.Popen, rank: int, out: Output, exits: dict) -> None:
    """Each rank's exit as the agent sees it: its status (the shell's 128 + N for a signal) and when."""
    rc = proc.wait(timeout=170)
    exits[rank] = {"code": 128 - rc if rc < 0 else rc, "t": out.now(), "stopped": False}


def record(case: Case, workdir: Path, out: Output, exits: dict) -> dict:
    lines = sorted(out.lines, key=lambda line: line["t"])
    for seq, line in enumerate(lines, 1):
        line["seq"] = seq
    files = dict(case.files)
    if (script := script_of(case)) is not None:
        files["train.py"] = script.read_text()
    return {
        "name": case.name,
        "expect": expectation(case),
        "command": ["python" if part == PY else part for part in case.command],
        "world_size": case.world,
        "workdir": str(workdir),
        "failure_class": case.failure_class,
        "exit_codes": {str(rank): exits[rank]["code"] for rank in sorted(exits)},
        "exits": {str(rank): exits[rank] for rank in sorted(exits)},
        "files": files,
        "lines": lines,
        "generated_with": f"python {sys.version.split()[0]}, torch {torch_version()}, as uid "
        + (str(JOB_UID) + " in bwrap" if case.sandbox else str(os.getuid())),
    }


def torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True)
    return out.stdout.decode().strip() or "none"


def rewrite_expectations() -> None:
    """Only the `expect` of each case file, from the table above: no program is run again."""
    for case in CASES:
        path = HERE / f"{case.name}.json"
        found = json.loads(path.read_text())
        found["expect"] = expectation(case)
        path.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--expectations"]:
        rewrite_expectations()
        sys.exit()
    wanted = set(sys.argv[1:])
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        found = run(case)
        (HERE / f"{case.name}.json").write_text(json.dumps(found, indent=1) + "\n")
        print(case.name, found["exit_codes"], len(found["lines"]), "lines", flush=True)
