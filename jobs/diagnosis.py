"""Why an attempt failed: a pure function over what is known of it, no database here.

`diagnose` reads the attempt's stored output lines (every rank's, in the order
they were stored), how it ended (state, failure class, exit status, the
agent's reason), the runtime limit and the health events of its nodes, and
says what went wrong: a category, a one-line summary, the evidence (the lines
by attempt/seq with rank and node), the first failing rank (the rank whose
error came first, not those that died of it after), a confidence and a hint
that says what to change. What it does not recognise is `unknown`, with the
last error lines: never a guess presented as fact.

`jobs/diagnosing.py` loads the inputs when an attempt ends badly and stores
the result on the attempt; `hang_suspected` (at the end) is the pure half of
hang detection while an attempt runs.
"""

import re
import signal
from dataclasses import asdict, dataclass, field

# Categories, and whether each is the job's own doing (user) or the infrastructure's.
CUDA_OOM = "cuda_oom"
HOST_OOM = "host_oom"
NAN_LOSS = "nan_loss"
COLLECTIVE_TIMEOUT = "collective_timeout"
NETWORK_ERROR = "network_error"
GPU_FAULT = "gpu_fault"
PYTHON_EXCEPTION = "python_exception"
IMPORT_ERROR = "import_error"
FILE_NOT_FOUND = "file_not_found"
PERMISSION = "permission"
SEGFAULT = "segfault"
ABORT = "abort"
TIMEOUT = "timeout"
CANCELLED = "cancelled"
PREEMPTED = "preempted"
NODE_LOST = "node_lost"
HANG = "hang"
ENVIRONMENT = "environment"
UNKNOWN = "unknown"
HANG_STOP = "stopped: hang suspected"  # how an attempt ended by stop_on_hang starts its reason

CATEGORIES = (
    CUDA_OOM, HOST_OOM, NAN_LOSS, COLLECTIVE_TIMEOUT, NETWORK_ERROR, GPU_FAULT, PYTHON_EXCEPTION, IMPORT_ERROR,
    FILE_NOT_FOUND, PERMISSION, SEGFAULT, ABORT, TIMEOUT, CANCELLED, PREEMPTED, NODE_LOST, HANG, ENVIRONMENT, UNKNOWN,
)  # fmt: skip
ENV_BUILD_FAILED = "environment build failed"  # how the agent's reason starts (agent/envcache.py)
# Errors a rank reports because another rank failed first: they never make a rank the first to fail
# while a root cause is seen on some rank.
FOLLOW_ON = {COLLECTIVE_TIMEOUT, NETWORK_ERROR}


@dataclass(frozen=True)
class Line:
    seq: int
    text: str
    rank: int = 0
    node: str = ""
    stream: str = "stdout"  # stdout | stderr | system
    attempt: int = 0


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


@dataclass(frozen=True)
class Event:
    """A health event on one of the attempt's nodes while it ran."""

    kind: str
    message: str
    node: str = ""
    action: str = ""
    source: str = "telemetry"
    pk: int = 0


@dataclass
class Diagnosis:
    category: str
    summary: str
    hint: str
    confidence: str = "high"  # high | medium | low
    first_failing_rank: int | None = None
    evidence: list[dict] = field(default_factory=list)

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Signal:
    """One recognised error on one rank: its category, the lines that show it, and details."""

    category: str
    line: Line
    summary: str
    hint: str
    lines: tuple[Line, ...] = ()
    confidence: str = "high"


# --- tracebacks -------------------------------------------------------------------------

_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXC = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning|Fault))(?::\s?(?P<msg>.*))?$")
_LIBRARY = ("site-packages", "dist-packages", "/lib/python3", "<frozen", "/usr/lib/python")


def strip(text: str) -> str:
    return _RANK_PREFIX.sub("", text)


@dataclass
class Traceback:
    start: Line
    frames: list[tuple[Line, str, int, str]] = field(default_factory=list)  # (line, path, lineno, func)
    exc_line: Line | None = None
    exc_type: str = ""
    message: str = ""

    def user_frame(self) -> tuple[Line, str, int, str] | None:
        """The deepest frame in the user's own files (not the libraries'), else the deepest."""
        own = [f for f in self.frames if not any(part in f[1] for part in _LIBRARY)]
        return own[-1] if own else (self.frames[-1] if self.frames else None)

    @property
    def short_type(self) -> str:
        return self.exc_type.rsplit(".", 1)[-1]


def tracebacks(lines: list[Line]) -> list[Traceback]:
    """Python tracebacks in one rank's lines, each with its frames and final exception line."""
    out: list[Traceback] = []
    current: Traceback | None = None
    for line in lines:
        text = strip(line.text)
        if text.startswith("Traceback (most recent call last):"):
            current = Traceback(line)
            out.append(current)
            continue
        if current is None or current.exc_line is not None:
            continue
        if frame := _FRAME.match(text):
            current.frames.append((line, frame["path"], int(frame["line"]), frame["func"]))
        elif (exc := _EXC.match(text)) and not text.startswith(" "):
            current.exc_line, current.exc_type, current.message = line, exc["type"], exc["msg"] or ""
    return [t for t in out if t.exc_line is not None]


# --- recognisers over single lines -------------------------------------------------------

_CUDA_OOM = re.compile(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError", re.I)
_OOM_TRIED = re.compile(r"Tried to allocate (?P<tried>[\d.]+ [KMGT]i?B)", re.I)
_OOM_FREE = re.compile(r"(?:of which|with) (?P<free>[\d.]+ [KMGT]i?B) (?:is )?free", re.I)
_OOM_TOTAL = re.compile(r"total capacity of (?P<total>[\d.]+ [KMGT]i?B)", re.I)
_HOST_OOM = re.compile(
    r"DefaultCPUAllocator: can't allocate memory|Cannot allocate memory|std::bad_alloc|^MemoryError\b"
    r"|Out of memory: Kill",
)
_HOST_TRIED = re.compile(r"you tried to allocate (?P<bytes>\d+) bytes")
_NAN = re.compile(
    r"(?:\bloss\b[^\n]{0,40}?[=:\s]\s*(?:-?nan|-?inf)\b)|returned nan values|\bloss is (?:nan|inf)\b|NaN or Inf found",
    re.I,
)
_COLLECTIVE_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout|Timed out waiting \d+ms|timed out after \d+|"
    r"DistStoreError: .*(?:timeout|Timed out)|Socket Timeout|NCCL.*timeout|collective operation timeout",
    re.I,
)
_NETWORK = re.compile(
    r"Connection closed by peer|Connection reset by peer|unhandled system error|ncclSystemError|ncclRemoteError|"
    r"remote process exited|NCCL WARN .*(?:failed|error)|Connection refused|Broken pipe|DistNetworkError",
    re.I,
)
_GPU_FAULT = re.compile(r"\bXid\b|uncorrectable ECC error|fallen off the bus|GPU is lost", re.I)
_SEGFAULT = re.compile(r"Segmentation fault|Fatal Python error: Segmentation fault|SIGSEGV", re.I)
_ABORT = re.compile(r"terminate called|Fatal Python error: Aborted|^Aborted\b|SIGABRT", re.I)


def size_to_bytes(text: str) -> int:
    number, unit = text.split()
    scale = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0].upper()]
    return int(float(number) * 1024**scale)


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# --- signals per rank ----------------------------------------------------------------------


def exception_signal(tb: Traceback, ending: Ending) -> Signal:
    """What a Python exception means: memory, environment, files, NaN, a collective, or the code."""
    frame = tb.user_frame()
    where = f" ({short_path(frame[1])}:{frame[2]} in {frame[3]})" if frame else ""
    evidence = tuple(x for x in (tb.exc_line, frame[0] if frame else None) if x is not None)
    text, kind = f"{tb.exc_type}: {tb.message}", tb.short_type
    message = tb.message[:300]
    if _CUDA_OOM.search(text):
        return cuda_oom_signal(tb.exc_line, evidence, where)
    if kind == "MemoryError" or _HOST_OOM.search(text):
        return host_oom_signal(tb.exc_line, evidence, ending, where)
    if kind in ("ModuleNotFoundError", "ImportError"):
        module = re.search(r"No module named '([^']+)'", tb.message)
        name = module.group(1) if module else tb.message
        return Signal(IMPORT_ERROR, tb.exc_line, f"{kind}: {message}{where}", import_hint(name), evidence)
    if kind in ("FileNotFoundError", "IsADirectoryError", "NotADirectoryError"):
        hint = (
            "The path does not exist where the job runs: paths are relative to the job's working directory "
            "(a fresh copy of its code); use a data mount, or check the name"
        )
        return Signal(FILE_NOT_FOUND, tb.exc_line, f"{kind}: {message}{where}", hint, evidence)
    if kind == "PermissionError":
        hint = "The job may not read or write that path: use its working directory, checkpoint dir or a writable volume"
        return Signal(PERMISSION, tb.exc_line, f"PermissionError: {message}{where}", hint, evidence)
    if _NAN.search(text) or kind == "FloatingPointError" and re.search(r"\b(nan|inf)\b", message, re.I):
        return nan_signal(tb.exc_line, evidence, where)
    if _COLLECTIVE_TIMEOUT.search(text):
        return collective_signal(tb.exc_line, evidence, where)
    if _NETWORK.search(text):
        return network_signal(tb.exc_line, evidence, where)
    hint = f"Fix the {kind} raised{where or ' in the job'}: {message}" if message else f"Fix the {kind}{where}"
    return Signal(PYTHON_EXCEPTION, tb.exc_line, f"{kind}: {message}{where}", hint, evidence)


def short_path(path: str) -> str:
    """A frame's file as the user knows it: relative to the job's working directory when it is there."""
    for marker in ("/hangar-job-", "/jobs/"):
        if marker in path:
            return path.split(marker, 1)[1].split("/", 1)[-1]
    return path.rsplit("/", 1)[-1] if any(part in path for part in _LIBRARY) else path


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


def host_oom_signal(line: Line, evidence: tuple, ending: Ending, where: str = "") -> Signal:
    tried = _HOST_TRIED.search(line.text)
    figure = f": tried to allocate {human(int(tried['bytes']))}" if tried else ""
    limit = f" (its limit is {ending.memory_limit_mb} MiB)" if ending.memory_limit_mb else ""
    summary = f"host memory exhausted{figure}{limit}{where}"
    hint = (
        "The process ran out of host (CPU) memory: load data lazily or in shards, lower the batch size or the "
        "number of DataLoader workers, or ask for a node with more memory"
    )
    return Signal(HOST_OOM, line, summary, hint, evidence)


def nan_signal(line: Line, evidence: tuple, where: str = "") -> Signal:
    hint = (
        "The loss became NaN/Inf: lower the learning rate (or add warm-up), clip gradients, check the inputs "
        "for NaN/Inf and divisions by zero, or use bf16 / a loss scaler in mixed precision"
    )
    return Signal(NAN_LOSS, line, f"NaN/Inf loss: {strip(line.text).strip()[:200]}{where}", hint, evidence or (line,))


def collective_signal(line: Line, evidence: tuple, where: str = "") -> Signal:
    hint = (
        "A collective (all_reduce, barrier, ...) waited for a rank that never joined: look at the other ranks' "
        "logs for the one that failed or was late; every rank must call the same collectives in the same order. "
        "Raise the process group's timeout only if a step is legitimately that slow"
    )
    return Signal(COLLECTIVE_TIMEOUT, line, f"collective timed out: {strip(line.text).strip()[:200]}", hint,
                  evidence or (line,))  # fmt: skip


def network_signal(line: Line, evidence: tuple, where: str = "") -> Signal:
    hint = (
        "The rank lost its connection to a peer: when another rank failed first, fix that rank's error; "
        "otherwise the network between the nodes may be at fault (rerun with NCCL_DEBUG=INFO)"
    )
    return Signal(NETWORK_ERROR, line, f"communication error: {strip(line.text).strip()[:200]}", hint,
                  evidence or (line,))  # fmt: skip


def import_hint(module: str) -> str:
    top = module.split(".")[0]
    return (
        f"Module {top!r} is not installed in the job's environment: add it to the environment's requirements "
        f"(or choose an environment that has it), or fix the name if it is a typo"
    )


def line_signals(lines: list[Line], ending: Ending) -> list[Signal]:
    """Errors recognised in single lines outside tracebacks (C++ and driver messages, printed losses)."""
    out = []
    for line in lines:
        text = strip(line.text)
        if line.stream == "system" or len(text) > 4000:
            continue
        if _NAN.search(text) and "Traceback" not in text:
            out.append(nan_signal(line, (line,)))
        elif _CUDA_OOM.search(text) and not text.lstrip().startswith(("File ", "raise", "torch.")):
            out.append(cuda_oom_signal(line, (line,)))
        elif _SEGFAULT.search(text):
            out.append(segfault_signal(line, ending))
        elif _ABORT.search(text):
            out.append(abort_signal(line, lines, ending))
        elif _COLLECTIVE_TIMEOUT.search(text):
            out.append(collective_signal(line, (line,)))
        elif _NETWORK.search(text):
            out.append(network_signal(line, (line,)))
        elif _GPU_FAULT.search(text):
            out.append(Signal(GPU_FAULT, line, f"the job's output reports a GPU fault: {text.strip()[:200]}",
                              gpu_hint(), (line,), "low"))  # fmt: skip
    return out


def segfault_signal(line: Line | None, ending: Ending) -> Signal:
    hint = (
        "A native library crashed (segmentation fault): run with PYTHONFAULTHANDLER=1 to see the Python stack, "
        "and check that compiled extensions match the installed torch/CUDA versions"
    )
    summary = "segmentation fault" + (f": {strip(line.text).strip()[:160]}" if line is not None else "")
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
    summary = "aborted" + (f": {strip(line.text).strip()[:160]}" if line is not None else " (SIGABRT)")
    return Signal(ABORT, line or Line(0, ""), summary, hint, evidence)


def gpu_hint() -> str:
    return (
        "A GPU or driver fault is the infrastructure's, not the job's: the attempt is requeued on another node. "
        "Nothing to change in the job, unless its output is the only report of it"
    )


def rank_signals(lines: list[Line], ending: Ending) -> list[Signal]:
    by_rank: dict[int, list[Line]] = {}
    for line in lines:
        by_rank.setdefault(line.rank, []).append(line)
    out = []
    for rank_lines in by_rank.values():
        traced = {t.exc_line.seq for t in tracebacks(rank_lines)}
        mine = [exception_signal(t, ending) for t in tracebacks(rank_lines)]
        mine += [s for s in line_signals(rank_lines, ending) if s.line.seq not in traced]
        out.extend(without_follow_on_aborts(mine))
    return out


def without_follow_on_aborts(signals: list[Signal]) -> list[Signal]:
    """An abort after a collective or communication error on the same rank is how the library gave
    up on that error (NCCL's watchdog aborts the process): the error is the diagnosis, not the abort."""
    first_comm = min((s.line.seq for s in signals if s.category in FOLLOW_ON), default=None)
    if first_comm is None:
        return signals
    return [s for s in signals if not (s.category == ABORT and s.line.seq > first_comm)]


# --- the whole attempt --------------------------------------------------------------------


def diagnose(lines: list[Line], ending: Ending, events: list[Event] = ()) -> Diagnosis:
    """Why the attempt ended badly (see the module's docstring)."""
    if (early := by_ending(ending, events)) is not None:
        return early
    if ending.reason.startswith(ENV_BUILD_FAILED):
        return environment_diagnosis(lines, ending)
    signals = rank_signals(sorted(lines, key=lambda x: x.seq), ending)
    chosen = choose(signals)
    if chosen is None:
        return by_exit_status(lines, ending)
    if chosen.category == GPU_FAULT and ending.failure_class != "infra":
        # A fault only the job's output claims, while the attempt failed as the job's own: say so.
        chosen = Signal(GPU_FAULT, chosen.line, chosen.summary + " (not corroborated by the node: the job's failure)",
                        "The node's re-check and driver saw no fault: look at the job's own error", chosen.lines,
                        "low")  # fmt: skip
    confidence, summary, rank = chosen.confidence, chosen.summary, chosen.line.rank
    evidence = list(chosen.lines or (chosen.line,))
    if chosen.category in FOLLOW_ON and ending.world_size > 1:
        confidence = "medium"  # no rank shows a cause: a peer may have died without a word
        if (gone := vanished_peer(lines, chosen.line)) is not None:
            rank, evidence = gone.rank, [gone, *evidence]
            how = strip(gone.text).removeprefix("[hangar] ")
            summary = f"rank {gone.rank} {how} first, with no error in its output; then {summary}"
    if chosen.category == NETWORK_ERROR and any(e.source == "output" and not trusted(e) for e in events):
        confidence, summary = "low", summary + " (reported only by the job's output; the node saw nothing)"
    return Diagnosis(chosen.category, summary, chosen.hint, confidence, rank, [ref(x) for x in evidence])


_NAMED_PACKAGE = re.compile(r"^environment build failed: package '([^']+)'")


def environment_diagnosis(lines: list[Line], ending: Ending) -> Diagnosis:
    """Its cached environment could not be built (the resolver's or the installer's message)."""
    package = _NAMED_PACKAGE.match(ending.reason)
    if package:
        hint = (
            f"Fix the requirement {package.group(1)!r}: check its name on the index (pip names, e.g. "
            "scikit-learn), its version specifier, and that a wheel exists for the node's Python and platform "
            "(source builds are off)"
        )
    else:
        hint = "Fix the requirements or python_version as the message says, then submit again"
    told = [x for x in lines if x.stream == "system" and x.text.startswith("[hangar] uv:")]
    evidence = [ref(x) for x in told[-5:]]
    rank = told[-1].rank if told else 0
    return Diagnosis(ENVIRONMENT, ending.reason[:500], hint, "high", rank, evidence)


_EXITED = re.compile(r"^\[hangar\] (?:exited with code [1-9]\d*|killed by SIG\w+)")


def vanished_peer(lines: list[Line], follow_on: Line) -> Line | None:
    """Another rank's exit that the agent recorded (its `[hangar] exited ...` line) before a rank
    reported losing a peer: the rank that vanished is the first to fail."""
    for line in sorted(lines, key=lambda x: x.seq):
        if line.seq >= follow_on.seq:
            return None
        if line.stream == "system" and line.rank != follow_on.rank and _EXITED.match(line.text):
            return line
    return None


def choose(signals: list[Signal]) -> Signal | None:
    """The first root cause by when it was stored; follow-on errors (a lost peer, a collective that
    timed out) only when no rank shows a cause; a GPU fault claimed only by output last."""
    ordered = sorted(signals, key=lambda s: s.line.seq)
    for tier in (
        [s for s in ordered if s.category not in FOLLOW_ON and s.confidence != "low"],
        [s for s in ordered if s.category in FOLLOW_ON],
        ordered,
    ):
        if tier:
            return tier[0]
    return None


def ref(line: Line) -> dict:
    return {"attempt": line.attempt, "seq": line.seq, "rank": line.rank, "node": line.node, "text": line.text[:500]}


def by_ending(ending: Ending, events: list[Event]) -> Diagnosis | None:
    """Endings that say why by themselves: a cancel, a preemption, the runtime limit, a lost node,
    a GPU fault the node's own driver (or a corroborated event) reported."""
    if ending.failure_class == "cancelled" or ending.state == "cancelled":
        return Diagnosis(CANCELLED, f"cancelled: {ending.reason or 'by a user'}", "Nothing failed: it was cancelled")
    if ending.failure_class == "preempted" or ending.state == "preempted":
        hint = "Preempted for higher-priority work: requeued; it resumes from HANGAR_CHECKPOINT_DIR if it saves there"
        return Diagnosis(PREEMPTED, f"preempted: {ending.reason}", hint)
    if ending.failure_class == "timeout":
        limit = f" of {ending.max_runtime_seconds}s" if ending.max_runtime_seconds else ""
        hint = "It ran past its max runtime: raise max_runtime_seconds, or checkpoint and resume in shorter attempts"
        return Diagnosis(TIMEOUT, f"stopped at its max runtime{limit}", hint)
    if ending.reason.startswith(HANG_STOP):
        hint = (
            "Its ranks went silent (a deadlock, a rank waiting on a collective others never call, a stuck data "
            "loader): add a timeout to the process group and print progress; py-spy dump shows where it waits"
        )
        return Diagnosis(HANG, ending.reason, hint, "medium")
    faults = [e for e in events if e.kind in ("xid", "ecc", "gpu_lost", "nccl") and trusted(e)]
    if ending.failure_class == "infra" and faults:
        e = faults[0]
        evidence = [{"health_event": e.pk, "node": e.node, "text": e.message}]
        if e.kind == "nccl":  # the node's network, corroborated: infra too
            hint = "The node's network failed (corroborated): the attempt is requeued elsewhere; nothing to change"
            return Diagnosis(NETWORK_ERROR, f"NCCL failure on {e.node or 'its node'}: {e.message}", hint, "high",
                             None, evidence)  # fmt: skip
        return Diagnosis(GPU_FAULT, f"{e.kind} on {e.node or 'its node'}: {e.message}", gpu_hint(), "high", None,
                         evidence)  # fmt: skip
    if ending.state == "lost" or re.search(r"went offline|lease expired|agent restarted|not started", ending.reason):
        hint = "The node or its agent was lost (infra): the job is requeued; nothing to change in the job"
        return Diagnosis(NODE_LOST, f"node lost: {ending.reason}", hint)
    return None


def trusted(event: Event) -> bool:
    """The driver's own report, or a job's report some other evidence corroborated."""
    return event.source != "output" or "cordoned" in event.action


def by_exit_status(lines: list[Line], ending: Ending) -> Diagnosis:
    """Nothing recognised in the output: what the exit status says, else `unknown` with the last errors."""
    code = ending.exit_code
    last = last_error_lines(lines)
    evidence = [ref(x) for x in last]
    if code == 128 + signal.SIGSEGV:
        s = segfault_signal(None, ending)
        return Diagnosis(SEGFAULT, "segmentation fault (killed by SIGSEGV, exit code 139)", s.hint, "high", None,
                         evidence)  # fmt: skip
    if code == 128 + signal.SIGABRT:
        s = abort_signal(None, lines, ending)
        return Diagnosis(ABORT, s.summary, s.hint, s.confidence, None, evidence)
    if code == 128 + signal.SIGKILL and ending.failure_class == "user":
        limit = f" (its memory limit is {ending.memory_limit_mb} MiB)" if ending.memory_limit_mb else ""
        summary = f"killed by SIGKILL (exit code 137) that the agent did not send: most likely the OOM killer{limit}"
        return Diagnosis(HOST_OOM, summary, host_oom_signal(Line(0, ""), (), ending).hint, "medium", None, evidence)
    status = f"exited with code {code}" if code is not None else (ending.reason or "ended")
    summary = f"{status}; no known error in its output" + (f" (last: {strip(last[-1].text)[:160]})" if last else "")
    hint = "Nothing in the output names the cause: read the last error lines (evidence) and the log around them"
    return Diagnosis(UNKNOWN, summary, hint, "low", last[-1].rank if last else None, evidence)


def last_error_lines(lines: list[Line], count: int = 5) -> list[Line]:
    errors = [x for x in lines if x.stream == "stderr"] or [x for x in lines if x.stream != "system"]
    return errors[-count:]


# --- hangs while an attempt runs ------------------------------------------------------------


@dataclass(frozen=True)
class Hang:
    ranks: tuple[int, ...]  # the silent ranks
    summary: str


def hang_suspected(
    last_output: dict[int, float | None],
    now: float,
    started: float,
    hang_seconds: float,
    world_size: int,
    gpus_idle: bool | None = None,
) -> Hang | None:
    """A rank silent for `hang_seconds` while another printed within that time; or every rank silent
    that long with its GPUs idle per telemetry (None: unknown, as on nodes without telemetry).
    `last_output` is each rank's last line time (None: no line yet, counted from `started`)."""
    if now - started < hang_seconds:
        return None
    seen = {r: (last_output.get(r) or started) for r in range(world_size)}
    silent = tuple(sorted(r for r, t in seen.items() if now - t >= hang_seconds))
    if not silent:
        return None
    if len(silent) < world_size:
        names = ", ".join(map(str, silent))
        return Hang(silent, f"rank {names} silent for over {hang_seconds:g}s while the other ranks print")
    if gpus_idle:
        return Hang(silent, f"every rank silent for over {hang_seconds:g}s and its GPUs idle")
    return None


# --- stragglers --------------------------------------------------------------------------------

_STEP = re.compile(r"\b(?:step|iter(?:ation)?|global_step)\s*[:=#]?\s*(\d+)", re.I)
STRAGGLER_FRACTION = 0.2  # a rank this far behind the leader's step count
STRAGGLER_MIN_STEPS = 5  # and at least this many steps behind (early noise is no straggler)


def step_of(text: str) -> int | None:
    """The step number a training line prints ("step 120", "iter=120", "global_step: 120"), if any."""
    match = _STEP.search(text)
    return int(match.group(1)) if match else None


def straggling(steps: dict[int, int]) -> Hang | None:
    """Ranks whose latest printed step is well below the leading rank's: they started together, so
    their step rate is that much lower, and every collective waits for them."""
    if len(steps) < 2:
        return None
    lead = max(steps.values())
    slow = tuple(
        sorted(r for r, s in steps.items() if s <= lead * (1 - STRAGGLER_FRACTION) and lead - s >= STRAGGLER_MIN_STEPS)
    )
    if not slow:
        return None
    behind = ", ".join(f"rank {r} at step {steps[r]}" for r in slow)
    return Hang(slow, f"straggler: {behind} while the leading rank is at step {lead}")
