"""What one rank's output says went wrong: each recognised error as a Signal (category, the
lines that show it, a summary and a hint). Pure: no database.

Recognisers read messages only: a traceback's exception line (with its frames for where), and
lines outside tracebacks that are not echoed source (see output.py). Of a rank's signals, a
printed NaN counts only when nothing else on that rank ended the run.
"""

import signal as signals
from dataclasses import dataclass, replace

from jobs.diagnosis.output import SYNTAX_ERRORS, Line, Sources, Traceback, chains, linear, resolve, scan, strip

CUDA_OOM = "cuda_oom"
HOST_OOM = "host_oom"
NAN_LOSS = "nan_loss"
COLLECTIVE_TIMEOUT = "collective_timeout"
NETWORK_ERROR = "network_error"
GPU_FAULT = "gpu_fault"
PYTHON_EXCEPTION = "python_exception"
SYNTAX_ERROR = "syntax_error"
IMPORT_ERROR = "import_error"
FILE_NOT_FOUND = "file_not_found"
PERMISSION = "permission"
DISK_FULL = "disk_full"
SEGFAULT = "segfault"
ABORT = "abort"
INTERRUPTED = "interrupted"
SCRIPT_EXIT = "script_exit"
USAGE_ERROR = "usage_error"
ENVIRONMENT = "environment"
# Errors a rank reports because another rank failed first: they never make a rank the first to fail
# while a root cause is seen on some rank.
FOLLOW_ON = {COLLECTIVE_TIMEOUT, NETWORK_ERROR}


@dataclass(frozen=True)
class Ending:
    """How the attempt ended, as the agent and the reconciler recorded it."""

    state: str = "failed"  # failed | lost | cancelled | preempted
    failure_class: str = "user"  # user | infra | timeout | cancelled | preempted
    exit_code: int | None = None  # shell convention: 128 + N for a signal
    reason: str = ""
    world_size: int = 1
    max_runtime_seconds: int | None = None
    memory_limit_mb: int = 0
    command: tuple[str, ...] = ()  # the job's argv


@dataclass(frozen=True)
class Signal:
    """One recognised error on one rank: its category, the lines that show it, and details."""

    category: str
    line: Line
    summary: str
    hint: str
    lines: tuple[Line, ...] = ()
    confidence: str = "high"
    weak: bool = False  # a side remark (a printed NaN, another program not found): the cause only when alone


# --- recognisers over messages ------------------------------------------------------------

_CUDA_OOM = linear(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError", ignore_case=True)
_OOM_TRIED = linear(r"Tried to allocate (?P<tried>[\d.]+ [KMGT]i?B)", ignore_case=True)
_OOM_FREE = linear(r"(?:of which|with) (?P<free>[\d.]+ [KMGT]i?B) (?:is )?free", ignore_case=True)
_OOM_TOTAL = linear(r"total capacity of (?P<total>[\d.]+ [KMGT]i?B)", ignore_case=True)
_HOST_OOM = linear(
    r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory|std::bad_alloc|^MemoryError\b"
    r"|Out of memory: Kill|Unable to allocate [\d.]+ [KMGTP]i?B for an array",
)
_HOST_TRIED = linear(r"you tried to allocate (?P<bytes>\d+) bytes|Unable to allocate (?P<size>[\d.]+ [KMGTP]i?B)")
_WORKER_KILLED = linear(r"DataLoader worker \(pid[^)]*\) is killed by signal: (?P<sig>[\w ]+?)\.?\s*$")
_NAN = linear(
    r"(?:\bloss\b[^\n]{0,40}?[=:\s]\s*(?:-?nan|-?inf)\b)|returned nan values|\bloss is (?:nan|inf)\b|NaN or Inf found",
    ignore_case=True,
)
_COLLECTIVE_TIMEOUT = linear(
    r"Watchdog caught collective operation timeout|Timed out waiting \d+ms|timed out after \d+|"
    r"DistStoreError: .*(?:timeout|Timed out)|Socket Timeout|NCCL.*timeout|collective operation timeout",
    ignore_case=True,
)
_NETWORK = linear(
    r"Connection closed by peer|Connection reset by peer|unhandled system error|ncclSystemError|ncclRemoteError|"
    r"remote process exited|NCCL WARN .*(?:failed|error)|Connection refused|Broken pipe|DistNetworkError",
    ignore_case=True,
)
_GPU_FAULT = linear(r"\bXid\b|uncorrectable ECC error|fallen off the bus|GPU is lost", ignore_case=True)
_SEGFAULT = linear(r"Segmentation fault|Fatal Python error: Segmentation fault|SIGSEGV", ignore_case=True)
_ABORT = linear(r"terminate called|Fatal Python error: Aborted|^Aborted\b|SIGABRT", ignore_case=True)
_DISK_FULL = linear(r"No space left on device|\[Errno 28\]|Disk quota exceeded|\[Errno 122\]|\bENOSPC\b")
# torch.save to a full disk names no errno: its zip writer finds fewer bytes written than it wrote.
_TORCH_SHORT_WRITE = linear(r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed writing file|file write failed")
_HANDLED_SIGNAL = linear(
    r"(?:caught|received|got)\s+(?:signal[:\s]*(?P<number>\d+)\b|(?:signal\s+)?(?:Signals\.)?(?P<name>SIG[A-Z]+)\b)"
    r"|Received (?:(?P<death>\d+)|Signals\.(?P<deathname>SIG[A-Z]+)) death signal",
    ignore_case=True,
)
_ARGPARSE = linear(r"^(?P<prog>\S+): error: (?P<error>.+)$")
_CLICK = linear(r"^Error: (?P<error>(?:Missing|No such|Invalid value|Got unexpected) .+)$")
_USAGE = linear(r"^usage: ", ignore_case=True)
# The launch itself: the sandbox, the shell, the dynamic loader, an installer the job runs.
_EXECVP = linear(r"^bwrap: execvp (?P<path>\S+): (?P<error>.+)$")
_CHDIR = linear(r"^bwrap: Can't chdir to (?P<path>.+): (?P<error>.+)$")
_BWRAP = linear(r"^(?:bwrap|setpriv): (?P<error>.+)$")
_NOT_FOUND = linear(
    r"^(?:\S*(?:bash|sh|zsh|dash)(?:: line \d+)?|/bin/sh: \d+): (?P<name>[^:\s]+): (?:command )?not found$"
    r"|^/usr/bin/env: '?(?P<env>[^':]+)'?: No such file or directory$"
)
_LOADER = linear(
    r"error while loading shared libraries: (?P<lib>\S+): (?P<error>.+)|(?P<lib2>\S+\.so[\d.]*): cannot open shared "
    r"object file|undefined symbol: (?P<sym>\S+)|version `GLIBC\w*_[\d.]+' not found"
)
_NO_CUDA = linear(r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|CUDA driver version is insufficient")
_INSTALLER = linear(
    r"^ERROR: (?P<pip>Could not find a version that satisfies the requirement|No matching distribution found for"
    r"|Could not install packages|Failed building wheel|ResolutionImpossible)"
    r"|^error: (?P<uv>No solution found when resolving dependencies|Failed to (?:download|build|fetch|prepare)\b.*)"
)
INTERPRETERS = linear(r"^(?:python[\d.]*|pip[\d.]*|torchrun|accelerate|deepspeed|uv|conda|jupyter)$")
_GOT_SIGNAL = linear(r"got signal: (\d+)")
_NAN_WORD = linear(r"\b(?:nan|inf)\b", ignore_case=True)
_NO_MODULE = linear(r"No module named '([^']+)'")
_NO_NAME = linear(r"cannot import name '([^']+)' from '([^']+)'")
_WARNED = linear(r":\d+: [A-Z]\w*Warning: ")


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def first_line(text: str) -> str:
    return strip(text).strip()[:200]


# --- exceptions -------------------------------------------------------------------------------


def exception_signal(tb: Traceback, ending: Ending) -> Signal:
    """What a Python exception means: syntax, the environment, memory, the disk, a signal, files,
    NaN, a collective, or the code."""
    frame = tb.user_frame()
    where = f" ({frame.where()})" if frame else ""
    evidence = tuple(x for x in (tb.exc_line, frame.line if frame else None) if x is not None)
    text, kind, message = f"{tb.exc_type}: {tb.message}", tb.short_type, tb.message[:300]
    if kind in SYNTAX_ERRORS:
        return syntax_signal(tb)
    if _CUDA_OOM.search(text):
        return cuda_oom_signal(tb.exc_line, evidence, where)
    if _NO_CUDA.search(text) or _LOADER.search(text):
        return environment_signal(tb.exc_line, f"{kind}: {message}{where}", environment_hint(text), evidence)
    if (kind.endswith("MemoryError") and "OutOfMemory" not in kind) or _HOST_OOM.search(text):
        return host_oom_signal(tb.exc_line, evidence, ending, where)
    if killed := _WORKER_KILLED.search(text):
        return worker_killed_signal(tb.exc_line, killed["sig"], evidence)
    if _DISK_FULL.search(text) or _TORCH_SHORT_WRITE.search(text):
        return disk_full_signal(tb.exc_line, f"{kind}: {message}{where}", evidence, bool(_DISK_FULL.search(text)))
    if kind == "KeyboardInterrupt" or (kind == "SignalException" and "got signal" in message):
        number = _GOT_SIGNAL.search(message)
        return interrupted_signal(tb.exc_line, f"{kind}{': ' + message if message else ''}{where}", evidence,
                                  int(number.group(1)) if number else signals.SIGINT)  # fmt: skip
    if kind in ("ModuleNotFoundError", "ImportError"):
        return import_signal(tb, kind, message, where, evidence)
    if kind in ("FileNotFoundError", "IsADirectoryError", "NotADirectoryError"):
        hint = (
            "The path does not exist where the job runs: paths are relative to the job's working directory "
            "(a fresh copy of its code); use a data mount, or check the name"
        )
        return Signal(FILE_NOT_FOUND, tb.exc_line, f"{kind}: {message}{where}", hint, evidence)
    if kind == "PermissionError":
        hint = "The job may not read or write that path: use its working directory, checkpoint dir or a writable volume"
        return Signal(PERMISSION, tb.exc_line, f"PermissionError: {message}{where}", hint, evidence)
    if _NAN.search(text) or kind == "FloatingPointError" and _NAN_WORD.search(message):
        return nan_signal(tb.exc_line, evidence, where)
    if (follow_on := follow_on_signal(tb.exc_line, text, evidence)) is not None:
        return follow_on
    return Signal(PYTHON_EXCEPTION, tb.exc_line, f"{kind}: {message}{where}", exception_hint(tb, ending), evidence)


def exception_hint(tb: Traceback, ending: Ending) -> str:
    frame, kind, message = tb.user_frame(), tb.short_type, tb.message[:300]
    where = f" ({frame.where()})" if frame else " in the job"
    hint = f"Fix the {kind} raised{where}: {message}" if message else f"Fix the {kind}{where}"
    if frame is not None and frame.resolved and frame.source:
        hint += f"; the line is `{frame.source}` in {frame.resolved}, which the job ran with exec"
    if kind == "JSONDecodeError":
        named = [a.split("=")[-1] for a in ending.command[1:] if a.endswith(".json")]
        files = ", ".join(dict.fromkeys(named)) or "the JSON files it reads"
        hint += f": a JSON document does not parse; check {files} (JSON allows no trailing commas or comments)"
    return hint


def syntax_signal(tb: Traceback) -> Signal:
    """Where Python could not read the code, and the text it showed."""
    where = next((f for f in reversed(tb.frames) if not f.func), None) or tb.user_frame()
    place = f"{where.shown}:{where.lineno}" if where else "the job's code"
    shown = f": `{tb.syntax_text}`" if tb.syntax_text else ""
    summary = f"{tb.short_type}: {tb.message[:200]} ({place}){shown}"
    hint = f"Fix the syntax at {place}{shown} ({tb.message[:200]})"
    if where is not None and where.resolved:
        hint += f"; {where.resolved} is run with exec by the job's code, so its errors show as <string>"
    evidence = tuple(x for x in (tb.exc_line, where.line if where else None) if x is not None)
    return Signal(SYNTAX_ERROR, tb.exc_line, summary, hint, evidence)


def import_signal(tb: Traceback, kind: str, message: str, where: str, evidence: tuple) -> Signal:
    missing, name = _NO_MODULE.search(tb.message), _NO_NAME.search(tb.message)
    if name:
        hint = (
            f"{name.group(1)!r} is not in {name.group(2)!r}: fix the name, or pin the version of "
            f"{name.group(2).split('.')[0]!r} that has it in the environment's requirements"
        )
    else:
        top = (missing.group(1) if missing else tb.message).split(".")[0]
        hint = (
            f"Module {top!r} is not installed in the job's environment: add it to the environment's requirements "
            f"(or choose an environment that has it), or fix the name if it is a typo"
        )
    return Signal(IMPORT_ERROR, tb.exc_line, f"{kind}: {message}{where}", hint, evidence)


def cuda_oom_signal(line: Line, evidence: tuple, where: str = "") -> Signal:
    text = " ".join(x.text for x in evidence) or line.text
    tried, free, total = (m.group(1) if (m := r.search(text)) else "" for r in (_OOM_TRIED, _OOM_FREE, _OOM_TOTAL))
    figures = ", ".join(x for x in (f"tried to allocate {tried}" if tried else "", f"{free} free" if free else "",
                                    f"of {total}" if total else "") if x)  # fmt: skip
    summary = "CUDA out of memory" + (f": {figures}" if figures else "") + where
    hint = (
        "The GPU ran out of memory: lower the batch size (or use gradient accumulation), enable activation "
        "checkpointing or bf16/mixed precision, or ask for a GPU type with more memory"
    )
    if tried and free:
        hint = f"Asked for {tried} with {free} free: " + hint[0].lower() + hint[1:]
    return Signal(CUDA_OOM, line, summary, hint, evidence)


HOST_OOM_HINT = (
    "The process ran out of host (CPU) memory: load data lazily or in shards, lower the batch size or the "
    "number of DataLoader workers, or ask for a node with more memory"
)


def host_oom_signal(line: Line, evidence: tuple, ending: Ending, where: str = "") -> Signal:
    tried = _HOST_TRIED.search(line.text)
    size = (human(int(tried["bytes"])) if tried["bytes"] else tried["size"]) if tried else ""
    figure = f": tried to allocate {size}" if size else ""
    if tried and tried["size"]:
        figure = f": Unable to allocate {size}"
    summary = f"host memory exhausted{figure}{memory_limit(ending)}{where}"
    return Signal(HOST_OOM, line, summary, HOST_OOM_HINT, evidence)


def memory_limit(ending: Ending) -> str:
    return f" (its memory limit is {ending.memory_limit_mb} MiB)" if ending.memory_limit_mb else ""


def worker_killed_signal(line: Line, how: str, evidence: tuple) -> Signal:
    """A DataLoader worker died of a signal: SIGKILL is the kernel's OOM killer as a rule."""
    summary = f"a DataLoader worker was killed by signal: {how}"
    if how.strip().lower() == "killed":
        summary += " (SIGKILL: most likely the kernel's OOM killer)"
        hint = (
            "A DataLoader worker ran out of host memory: lower num_workers (each worker holds its own copy of "
            "the dataset object), load data lazily, or ask for a node with more memory"
        )
        return Signal(HOST_OOM, line, summary, hint, evidence, "medium")
    if "segmentation" in how.lower():
        return Signal(SEGFAULT, line, summary, segfault_signal(None).hint, evidence)
    return Signal(PYTHON_EXCEPTION, line, summary, "A DataLoader worker died: run with num_workers=0 to see its error",
                  evidence, "medium")  # fmt: skip


def disk_full_signal(line: Line, summary: str, evidence: tuple, named: bool = True) -> Signal:
    hint = (
        "The disk the job writes to is full: free space or write checkpoints and outputs to a larger volume, keep "
        "fewer checkpoints, or ask for a node with more disk"
    )
    if not named:
        summary += " (a short write: the disk is most likely full)"
    return Signal(DISK_FULL, line, summary, hint, evidence or (line,), "high" if named else "medium")


def interrupted_signal(line: Line, summary: str, evidence: tuple, number: int, confidence: str = "high") -> Signal:
    name = signal_name(number)
    hint = (
        f"The run was ended by {name}, which Hangar did not send (its own stops, cancel, preemption and the "
        "runtime limit, are named as such): something on the node or in the job signalled it (a kill, Ctrl-C, "
        "a launcher or scheduler outside Hangar). Submit again; save checkpoints on SIGTERM to resume"
    )
    return Signal(INTERRUPTED, line, summary, hint, evidence or (line,), confidence)


def killed_signal(number: int, how: str, line: Line, evidence: tuple, ending: Ending) -> Signal | None:
    """A process killed by signal `number` with nothing in its output to say more: what most likely
    sent it. `how` says how it ended (the summary's start)."""
    if number == signals.SIGKILL:
        summary = f"{how}: most likely the kernel's OOM killer{memory_limit(ending)}"
        return Signal(HOST_OOM, line, summary, HOST_OOM_HINT, evidence, "medium")
    if number == signals.SIGSEGV:
        return Signal(SEGFAULT, line, f"{how}: segmentation fault", segfault_signal(None).hint, evidence)
    if number in (signals.SIGTERM, signals.SIGINT, signals.SIGHUP):
        return interrupted_signal(line, how, evidence, number, "medium")
    return None


def signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return f"signal {number}"


def nan_signal(line: Line, evidence: tuple, where: str = "") -> Signal:
    hint = (
        "The loss became NaN/Inf: lower the learning rate (or add warm-up), clip gradients, check the inputs "
        "for NaN/Inf and divisions by zero, or use bf16 / a loss scaler in mixed precision"
    )
    return Signal(NAN_LOSS, line, f"NaN/Inf loss: {first_line(line.text)}{where}", hint, evidence or (line,))


# The FOLLOW_ON errors, in the order they are looked for: how each is recognised, said and answered.
_FOLLOW_ONS = (
    (COLLECTIVE_TIMEOUT, _COLLECTIVE_TIMEOUT, "collective timed out", (
        "A collective (all_reduce, barrier, ...) waited for a rank that never joined: look at the other ranks' "
        "logs for the one that failed or was late; every rank must call the same collectives in the same order. "
        "Raise the process group's timeout only if a step is legitimately that slow"
    )),
    (NETWORK_ERROR, _NETWORK, "communication error", (
        "The rank lost its connection to a peer: when another rank failed first, fix that rank's error; "
        "otherwise the network between the nodes may be at fault (rerun with NCCL_DEBUG=INFO)"
    )),
)  # fmt: skip


def follow_on_signal(line: Line, text: str, evidence: tuple = ()) -> Signal | None:
    """A collective that timed out or a lost peer, as `text` (the line's, or its exception's) says."""
    for category, pattern, what, hint in _FOLLOW_ONS:
        if pattern.search(text):
            return Signal(category, line, f"{what}: {first_line(line.text)}", hint, evidence or (line,))
    return None


def gpu_hint() -> str:
    return (
        "A GPU or driver fault is the infrastructure's, not the job's: the attempt is requeued on another node. "
        "Nothing to change in the job, unless its output is the only report of it"
    )


def segfault_signal(line: Line | None) -> Signal:
    hint = (
        "A native library crashed (segmentation fault): run with PYTHONFAULTHANDLER=1 to see the Python stack, "
        "and check that compiled extensions match the installed torch/CUDA versions"
    )
    summary = "segmentation fault" + (f": {first_line(line.text)[:160]}" if line is not None else "")
    return Signal(SEGFAULT, line or Line(0, ""), summary, hint, (line,) if line is not None else ())


BARRIER_HINT = (
    "The rank had finished its work and then aborted at exit: call dist.barrier() before "
    "dist.destroy_process_group() so no rank tears down the process group while another still uses it"
)


def abort_signal(line: Line | None, lines: list[Line], ending: Ending) -> Signal:
    """An abort (SIGABRT). In a multi-rank job after the rank's last output and without a traceback,
    it is the known teardown race of destroy_process_group without a barrier (see TRAPS.md)."""
    rank = line.rank if line is not None else 0
    own = [x for x in lines if x.rank == rank and x.stream != "system"]
    traced = any(strip(x.text).startswith("Traceback") for x in own)
    after_work = own and line is not None and own[-1] == line and len(own) >= 2
    evidence = tuple(x for x in (own[-2] if after_work else None, line) if x is not None)
    quiet = line is None or "without an active exception" in line.text  # not a C++ exception's abort
    if ending.world_size > 1 and not traced and quiet and (after_work or line is None):
        summary = f"rank {rank} aborted at exit after its last output (no barrier before destroy_process_group?)"
        return Signal(ABORT, line or Line(0, ""), summary, BARRIER_HINT, evidence, "medium")
    hint = "The process aborted (SIGABRT): the lines before the abort say which library gave up and why"
    summary = "aborted" + (f": {first_line(line.text)[:160]}" if line is not None else " (SIGABRT)")
    return Signal(ABORT, line or Line(0, ""), summary, hint, evidence)


# --- the environment ------------------------------------------------------------------------------


def environment_signal(line: Line, summary: str, hint: str, evidence: tuple = (), confidence: str = "high") -> Signal:
    return Signal(ENVIRONMENT, line, summary, hint, evidence or (line,), confidence)


def environment_hint(text: str) -> str:
    if _NO_CUDA.search(text):
        return (
            "The environment's torch is a CPU-only build (or the node has no NVIDIA driver): install a CUDA build of "
            "torch that matches the node's driver (the PyTorch index for its CUDA version), or run on CPU"
        )
    lib = _LOADER.search(text)
    name = (lib["lib"] or lib["lib2"] or lib["sym"] or "a library") if lib else "a library"
    return (
        f"A shared library the program needs ({name}) is missing from the environment or does not match it: "
        "install the package that provides it (for CUDA libraries, the torch/CUDA build the node's driver supports), "
        "or fix LD_LIBRARY_PATH"
    )


def launch_signal(line: Line, text: str, ending: Ending) -> Signal | None:
    """The launch could not start the program: the sandbox, the shell or the loader says so."""
    if match := _EXECVP.match(text):
        hint = execvp_hint(match["path"], match["error"])
        return environment_signal(line, f"the job could not be started: {text}", hint)
    if match := _CHDIR.match(text):
        hint = (
            f"The job's working directory {match['path']} does not exist or the job's uid cannot enter it "
            "(a directory under /root or another 0700 home, or under /tmp, which the sandbox replaces): "
            "give the job a working directory job uids can reach, or submit its code with --code"
        )
        return environment_signal(line, f"the job could not be started: {text}", hint)
    if match := _NOT_FOUND.match(text):
        name = match["name"] or match["env"]
        found = environment_signal(line, f"a program was not found: {text}", not_found_hint(name))
        # The job's own program missing ends it; another program a script calls may be a side remark.
        return replace(found, weak=not launched_program(name, ending.command))
    if _LOADER.search(text) and "error while loading shared libraries" in text:
        found = environment_signal(line, f"a program could not be loaded: {text}", environment_hint(text))
        return replace(found, weak=not launched_program(text.split(":", 1)[0].rsplit("/", 1)[-1], ending.command))
    if _BWRAP.match(text):
        hint = "The sandbox could not start the job: the message names what it could not set up; tell the operator"
        return environment_signal(line, f"the job could not be started: {text}", hint)
    return None


def launched_program(name: str, command: tuple[str, ...]) -> bool:
    """Whether `name` is what the job's command runs: its program, the program of a `bash -c`
    script, or an interpreter."""
    if INTERPRETERS.match(name) or not command:
        return True
    programs = {command[0].rsplit("/", 1)[-1]}
    if len(command) > 2 and command[1] == "-c":
        programs.add(command[2].split()[0].rsplit("/", 1)[-1] if command[2].split() else "")
    return name.rsplit("/", 1)[-1] in programs


def execvp_hint(path: str, error: str) -> str:
    program = "interpreter" if INTERPRETERS.match(path.rsplit("/", 1)[-1]) else "program"
    if "/" not in path:
        return (
            f"{path!r} was looked up on the job's PATH and a directory there is not readable by the job's uid "
            "(such as /root/.pyenv/shims): set PATH in the job's env to directories job uids can read, or run the "
            f"{program} by its full path, one outside /root and /tmp"
        )
    if "Permission denied" in error:
        return (
            f"The job's uid may not run {path} (it, or a directory above it, is private: /root is 0700): build the "
            f"job's environment from {'an interpreter' if program == 'interpreter' else 'a program'} job uids can run "
            "(e.g. /usr/bin/python3), or use a Hangar "
            "environment (requirements)"
        )
    return (
        f"The {program} {path} does not exist as the job sees it in its sandbox: a venv whose python links into "
        "a directory job uids cannot enter (such as /root/.pyenv), or one under /tmp, which the sandbox replaces. "
        "Build the environment outside /root and /tmp from a system python (e.g. /usr/bin/python3), or use a "
        "Hangar environment (requirements)"
    )


def not_found_hint(name: str) -> str:
    if INTERPRETERS.match(name):
        return (
            f"{name} is not on the job's PATH: name the interpreter by its full path (one job uids can run, "
            "outside /root and /tmp), set PATH in the job's env, or give the job an environment (requirements) "
            "that provides it"
        )
    return (
        f"{name!r} is not installed on the node or not on the job's PATH: install it in the job's environment, "
        "or call it by its full path"
    )


def installer_signal(line: Line, lines: list[Line]) -> Signal:
    """pip or uv, run by the job itself, could not install what it asked for."""
    near = (x for x in lines if x.stream == line.stream and line.seq <= x.seq <= line.seq + 2)
    evidence = tuple(x for x in near if strip(x.text).strip())
    hint = (
        "The job's own package install failed: check the names and versions it asks for exist for the node's Python "
        "and platform; better, declare them in the job's requirements, so Hangar builds the environment once per "
        "node and reuses it"
    )
    return environment_signal(line, f"a package install failed: {first_line(line.text)}", hint, evidence)


# --- lines outside tracebacks ----------------------------------------------------------------------


def line_signals(lines: list[Line], skip: set[int], ending: Ending) -> list[Signal]:
    """Errors recognised in single lines outside tracebacks (C++, driver, launcher and installer
    messages, printed losses). `skip`: the seqs of traceback lines and echoed source."""
    out = []
    for i, line in enumerate(lines):
        text = strip(line.text)
        if line.stream == "system" or line.seq in skip or len(text) > 4000 or not text.strip():
            continue
        found = single_line_signal(line, text, lines, i, ending)
        if found is not None:
            out.append(found)
    return out


def single_line_signal(line: Line, text: str, lines: list[Line], i: int, ending: Ending) -> Signal | None:
    if (launched := launch_signal(line, text, ending)) is not None:
        return launched
    if _INSTALLER.match(text):
        return installer_signal(line, lines)
    if _NO_CUDA.search(text):
        return environment_signal(line, first_line(text), environment_hint(text))
    if _NAN.search(text) and "Traceback" not in text:
        return replace(nan_signal(line, (line,)), weak=True)
    if _CUDA_OOM.search(text) and not text.lstrip().startswith(("File ", "raise", "torch.")):
        return cuda_oom_signal(line, (line,))
    if _DISK_FULL.search(text):
        return disk_full_signal(line, f"disk full: {first_line(text)}", (line,))
    if (usage := usage_signal(line, text, lines, i)) is not None:
        return usage
    if _SEGFAULT.search(text):
        return segfault_signal(line)
    if _ABORT.search(text):
        return abort_signal(line, lines, ending)
    if (follow_on := follow_on_signal(line, text)) is not None:
        return follow_on
    if handled := _HANDLED_SIGNAL.search(text):
        number = signal_number(next(v for v in handled.groupdict().values() if v))
        if number in (signals.SIGTERM, signals.SIGINT, signals.SIGHUP, signals.SIGQUIT):
            return interrupted_signal(line, f"ended by {signal_name(number)}: {first_line(text)}", (line,), number,
                                      "medium")  # fmt: skip
    if _GPU_FAULT.search(text):
        summary = f"the job's output reports a GPU fault: {first_line(text)}"
        return Signal(GPU_FAULT, line, summary, gpu_hint(), (line,), "low")
    return None


def signal_number(name: str) -> int:
    name = name.upper().removeprefix("SIGNALS.")
    if name.isdigit():
        return int(name)
    try:
        return int(signals.Signals[name])
    except KeyError:
        return 0


def usage_signal(line: Line, text: str, lines: list[Line], i: int) -> Signal | None:
    """argparse's (and click's) refusal of the command line: `usage: …` then `prog: error: …`."""
    match = _ARGPARSE.match(text) or _CLICK.match(text)
    if match is None:
        return None
    before = [x for x in lines[max(0, i - 8) : i] if x.stream == line.stream]
    usage = next((x for x in reversed(before) if _USAGE.match(strip(x.text))), None)
    if usage is None:
        return None
    hint = (
        f"The command's arguments do not match what the program accepts ({strip(usage.text).strip()[:300]}): "
        f"fix the job's command ({match['error'][:200]})"
    )
    return Signal(USAGE_ERROR, line, f"usage error: {match['error'][:300]}", hint, (line, usage))


# --- one rank --------------------------------------------------------------------------------------


def rank_signals(lines: list[Line], ending: Ending, files: Sources | None = None) -> list[Signal]:
    """Every root cause and follow-on error seen in one rank's lines (in seq order). A printed NaN
    counts only when nothing else on the rank ended the run (an exception, a crash, a message)."""
    found = scan(lines)
    mine = []
    for chain in chains(found.tracebacks):
        if any(tb.noise for tb in chain) or all(is_child_report(tb) for tb in chain):
            continue
        for tb in chain:
            resolve(tb, files or {}, ending.command)
        mine.append(chain_signal(chain, ending))
    mine += line_signals(lines, found.inside | found.echoes, ending)
    mine = without_follow_on_aborts(sorted(mine, key=lambda s: s.line.seq))
    if any(not s.weak and s.category not in FOLLOW_ON and s.confidence != "low" for s in mine):
        mine = [s for s in mine if not s.weak]
    return mine


def chain_signal(chain: list[Traceback], ending: Ending) -> Signal:
    """One failure's exceptions, root cause first: the first that says more than "an exception"
    (torch.save's short write surfaces in the second), else the root cause."""
    found = [exception_signal(tb, ending) for tb in chain]
    return next((s for s in found if s.category != PYTHON_EXCEPTION), found[0])


def is_child_report(tb: Traceback) -> bool:
    """A launcher's report that a child failed (torchrun's ChildFailedError): the child's own output says why."""
    return tb.short_type in ("ChildFailedError", "CalledProcessError")


def without_follow_on_aborts(found: list[Signal]) -> list[Signal]:
    """An abort after a collective or communication error on the same rank is how the library gave
    up on that error (NCCL's watchdog aborts the process): the error is the diagnosis, not the abort."""
    first_comm = min((s.line.seq for s in found if s.category in FOLLOW_ON), default=None)
    if first_comm is None:
        return found
    return [s for s in found if not (s.category == ABORT and s.line.seq > first_comm)]


# What programs print to stderr that is no message of theirs: warnings, progress bars, log lines
# below ERROR (Python's logging, glog's I/W prefixes).
_NOT_A_MESSAGE = linear(
    r"\w*Warning: |^warnings\.warn|^\[?[IWD]\d{4} |\d+%\||\bit/s\]|s/it\]|\r"
    r"|^(?:\[?\d{4}-\d\d-\d\d[^\]]*\]?\s*)?\[?(?:INFO|DEBUG|WARNING|WARN|TRACE)\b"
)


def last_message(lines: list[Line], skip: set[int]) -> Line | None:
    """The rank's last line on stderr that is a message of its own (not a warning, an echo or a
    traceback): what `sys.exit("…")` and most scripts print before they stop."""
    for line in reversed(lines):
        text = strip(line.text).strip()
        if line.stream != "stderr" or line.seq in skip or not text:
            continue
        if _NOT_A_MESSAGE.search(text):
            continue
        return line
    return None


def scanned_skip(lines: list[Line]) -> set[int]:
    found = scan(lines)
    warned = {x.seq for x in lines if _WARNED.search(strip(x.text))}
    return found.inside | found.echoes | warned
