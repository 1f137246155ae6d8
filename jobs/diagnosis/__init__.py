"""Why an attempt failed: a pure function over what is known of it, no database here.

`diagnose` reads the attempt's stored output lines (every rank's, in the order they were
stored), how it ended (state, failure class, exit status, the agent's reason, the command),
each rank's exit as the agent recorded it (status, when, whether the agent stopped it), the
runtime limit, the health events of its nodes and, when a traceback ran code through `exec`,
the job's files it may have run. It says what went wrong: a category, a one-line summary, the
evidence (the lines by attempt/seq with rank and node), the first failing rank (the rank that
failed first by its exit, not those that died of it after), a confidence and a hint that says
what to change. What it does not recognise is `unknown`, with the last error lines: never a
guess presented as fact.

Reading the output is `output.py` (tracebacks, echoed source); recognising errors in one rank's
lines is `signals.py`; hangs and stragglers while an attempt runs are `hangs.py`.
`jobs/diagnosing.py` loads the inputs when an attempt ends badly and stores the result.
"""

import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from jobs.diagnosis.hangs import Hang, hang_suspected, step_of, straggling
from jobs.diagnosis.output import Line, linear, short_path, sources_of, strip, wanted_files
from jobs.diagnosis.signals import (
    ABORT,
    COLLECTIVE_TIMEOUT,
    CUDA_OOM,
    DISK_FULL,
    ENVIRONMENT,
    FILE_NOT_FOUND,
    FOLLOW_ON,
    GPU_FAULT,
    HOST_OOM,
    IMPORT_ERROR,
    INTERRUPTED,
    NAN_LOSS,
    NETWORK_ERROR,
    PERMISSION,
    PYTHON_EXCEPTION,
    SCRIPT_EXIT,
    SEGFAULT,
    SYNTAX_ERROR,
    USAGE_ERROR,
    Ending,
    Signal,
    abort_signal,
    gpu_hint,
    killed_signal,
    last_message,
    not_found_hint,
    rank_signals,
    scanned_skip,
    signal_name,
)

__all__ = [
    "CATEGORIES", "Diagnosis", "Ending", "Event", "Hang", "Line", "RankExit", "diagnose", "hang_suspected",
    "short_path", "step_of", "straggling", "wanted_files",
]  # fmt: skip

TIMEOUT = "timeout"
CANCELLED = "cancelled"
PREEMPTED = "preempted"
NODE_LOST = "node_lost"
HANG = "hang"
UNKNOWN = "unknown"
HANG_STOP = "stopped: hang suspected"  # how an attempt ended by stop_on_hang starts its reason
ENV_BUILD_FAILED = "environment build failed"  # how the agent's reason starts (agent/envcache.py)

# Every category, in a stable order: the API, the CLI and MLflow tags carry these names.
CATEGORIES = (
    CUDA_OOM, HOST_OOM, NAN_LOSS, COLLECTIVE_TIMEOUT, NETWORK_ERROR, GPU_FAULT, PYTHON_EXCEPTION, IMPORT_ERROR,
    FILE_NOT_FOUND, PERMISSION, SEGFAULT, ABORT, TIMEOUT, CANCELLED, PREEMPTED, NODE_LOST, HANG, ENVIRONMENT, UNKNOWN,
    SYNTAX_ERROR, DISK_FULL, INTERRUPTED, SCRIPT_EXIT, USAGE_ERROR,
)  # fmt: skip


@dataclass(frozen=True)
class Event:
    """A health event on one of the attempt's nodes while it ran."""

    kind: str
    message: str
    node: str = ""
    action: str = ""
    source: str = "telemetry"
    pk: int = 0


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended, as its agent saw it."""

    code: int | None  # shell convention: 128 + N for a signal; None: no process or not known
    at: float | None = None  # when its agent saw it exit (seconds on one clock for all the attempt's ranks)
    stopped: bool = False  # the agent stopped it (cancel, preemption, runtime limit, another rank's failure)
    line: Line | None = None  # the agent's `[hangar] exited …` line, when it was read from the log


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


def diagnose(
    lines: list[Line],
    ending: Ending,
    events: list[Event] = (),
    exits: Mapping[int, RankExit] | None = None,
    files: Mapping[str, str] | None = None,
) -> Diagnosis:
    """Why the attempt ended badly (see the module's docstring). `exits`: each rank's exit; when
    not given, read from the agent's `[hangar] exited …` lines, in the order they were stored.
    `files`: the job's files a `File "<string>"` frame may have run (see `wanted_files`)."""
    if (early := by_ending(ending, events)) is not None:
        return early
    if ending.reason.startswith(ENV_BUILD_FAILED):
        return environment_diagnosis(lines, ending)
    ordered = sorted(lines, key=lambda x: x.seq)
    if (launch := launch_failure(ordered, ending)) is not None:
        return launch
    exits = merged(exits_from_lines(ordered), exits or {})
    by_rank = own_lines(ordered)
    sources = sources_of(dict(files or {}))
    found = [s for rank_lines in by_rank.values() for s in rank_signals(rank_lines, ending, sources)]
    order = failure_order(exits)
    chosen = choose(found, order, exits, by_rank, ending)
    if chosen is None:
        return by_exit_status(by_rank, ending, exits, order)
    return described(chosen, found, order, exits, ending, events, by_rank)


def described(chosen: Signal, found: list[Signal], order: list[int], exits: Mapping[int, RankExit],
              ending: Ending, events: list[Event], by_rank: dict[int, list[Line]]) -> Diagnosis:  # fmt: skip
    """The chosen signal as a diagnosis: a fault claimed only by output, or a follow-on error after
    a rank that vanished without a word, said as such."""
    if chosen.category == GPU_FAULT and ending.failure_class != "infra":
        # A fault only the job's output claims, while the attempt failed as the job's own: say so.
        chosen = Signal(GPU_FAULT, chosen.line, chosen.summary + " (not corroborated by the node: the job's failure)",
                        "The node's re-check and driver saw no fault: look at the job's own error", chosen.lines,
                        "low")  # fmt: skip
    confidence, summary, rank = chosen.confidence, chosen.summary, chosen.line.rank
    evidence = list(chosen.lines or (chosen.line,))
    if chosen.category in FOLLOW_ON and ending.world_size > 1:
        confidence = "medium"  # no rank shows a cause: a peer may have died without a word
        if (gone := vanished(chosen, found, order)) is not None:
            rank, how = gone, describe_exit(exits[gone].code)
            own = [x for x in by_rank.get(gone, []) if x.stream != "system"]
            evidence = [x for x in (exits[gone].line or (own[-1] if own else None),) if x is not None] + evidence
            summary = f"rank {gone} {how} first, with no error in its output; then {summary}"
    if chosen.category == NETWORK_ERROR and any(e.source == "output" and not trusted(e) for e in events):
        confidence, summary = "low", summary + " (reported only by the job's output; the node saw nothing)"
    return Diagnosis(chosen.category, summary, chosen.hint, confidence, rank, [ref(x) for x in evidence])


# --- ranks' exits ---------------------------------------------------------------------------------

_EXITED = linear(r"^\[hangar\] (?:exited with code (?P<code>-?\d+)|killed by SIG\w+ \(exit code (?P<signal>\d+)\))")
_STOPPING = "[hangar] stopping:"
_COULD_NOT_START = linear(r"^\[hangar\] could not start (?P<what>.+?): (?P<error>.+)$")


def exits_from_lines(lines: list[Line]) -> dict[int, RankExit]:
    """Each rank's exit as its agent wrote it in the log (`[hangar] exited with code 1`, `[hangar]
    killed by SIGKILL (exit code 137)`, `[hangar] stopping: …`): no times, their stored order only."""
    out: dict[int, RankExit] = {}
    for line in lines:
        if line.stream != "system":
            continue
        if line.text.startswith(_STOPPING):
            out[line.rank] = RankExit(None, stopped=True, line=line)
        elif (match := _EXITED.match(line.text)) and line.rank not in out:
            out[line.rank] = RankExit(int(match["code"] or match["signal"]), line=line)
    return out


def merged(logged: Mapping[int, RankExit], recorded: Mapping[int, RankExit]) -> dict[int, RankExit]:
    """The recorded exits over those read from the log; a rank the log shows the agent stopping stays stopped."""
    out = {**logged, **recorded}
    for rank in logged.keys() & recorded.keys():
        if logged[rank].stopped:
            out[rank] = RankExit(recorded[rank].code, recorded[rank].at, True, recorded[rank].line)
    return out


def failure_order(exits: Mapping[int, RankExit]) -> list[int]:
    """The ranks that failed on their own (not stopped by the agent, non-zero), first failure first:
    by when they exited where the agent recorded it, else by where their exit line was stored."""

    def when(rank: int) -> tuple:
        e = exits[rank]
        return (e.at is None, e.at or 0.0, e.line.seq if e.line is not None else 0, rank)

    return sorted((r for r, e in exits.items() if e.code not in (None, 0) and not e.stopped), key=when)


def own_lines(lines: list[Line]) -> dict[int, list[Line]]:
    """Each rank's lines up to the agent's stop of it: what a rank prints once it is being stopped
    (a SIGTERM handler's message, a KeyboardInterrupt) is the stop's doing, not a cause."""
    out: dict[int, list[Line]] = {}
    stopped: set[int] = set()
    for line in lines:
        if line.rank in stopped:
            continue
        out.setdefault(line.rank, []).append(line)
        if line.stream == "system" and line.text.startswith(_STOPPING):
            stopped.add(line.rank)
    return out


def describe_exit(code: int | None) -> str:
    if code is not None and code > 128:
        return f"was killed by {signal_name(code - 128)} (exit code {code})"
    return f"exited with code {code}"


# --- choosing the first failure -----------------------------------------------------------------


def choose(found: list[Signal], order: list[int], exits: Mapping[int, RankExit], by_rank: dict[int, list[Line]],
           ending: Ending) -> Signal | None:  # fmt: skip
    """The root cause on the rank that failed first by its exit (by when it was stored where no
    exit says); follow-on errors (a lost peer, a collective that timed out) only when no rank
    shows a cause; a GPU fault claimed only by output last. A rank killed by a signal without a
    word (the OOM killer's SIGKILL) is a root cause of its own."""
    position = {rank: i for i, rank in enumerate(order)}
    silent = [s for r in order if (s := silent_death(r, exits[r], found, by_rank.get(r, []), ending)) is not None]
    roots = [s for s in found if s.category not in FOLLOW_ON and s.confidence != "low"] + silent
    if roots:
        return min(roots, key=lambda s: (position.get(s.line.rank, len(order)), s.line.seq))
    for tier in ([s for s in found if s.category in FOLLOW_ON], found):
        if tier:
            return min(tier, key=lambda s: s.line.seq)
    return None


def silent_death(rank: int, exit: RankExit, found: list[Signal], lines: list[Line], ending: Ending) -> Signal | None:
    """A rank of a multi-rank attempt killed by a signal with nothing in its output: what its exit says."""
    if ending.world_size < 2 or exit.code is None or exit.code <= 128 or any(s.line.rank == rank for s in found):
        return None
    own = [x for x in lines if x.stream != "system"]
    at = exit.line or (own[-1] if own else Line(0, "", rank))
    how = f"rank {rank} {describe_exit(exit.code)} first, with no error in its output"
    evidence = tuple(x for x in (exit.line, own[-1] if own else None) if x is not None)
    return killed_signal(exit.code - 128, how, at, evidence, ending)


def vanished(chosen: Signal, found: list[Signal], order: list[int]) -> int | None:
    """The rank that failed before the one reporting a lost peer and printed no error: the first to fail."""
    noisy = {s.line.rank for s in found}
    before = order[: order.index(chosen.line.rank)] if chosen.line.rank in order else order
    return next((r for r in before if r != chosen.line.rank and r not in noisy), None)


def ref(line: Line) -> dict:
    return {"attempt": line.attempt, "seq": line.seq, "rank": line.rank, "node": line.node, "text": line.text[:500]}


# --- endings that say why by themselves ------------------------------------------------------------

_NODE_LOST = linear(r"went offline|lease expired|agent restarted|not started")


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
    if ending.state == "lost" or _NODE_LOST.search(ending.reason):
        hint = "The node or its agent was lost (infra): the job is requeued; nothing to change in the job"
        return Diagnosis(NODE_LOST, f"node lost: {ending.reason}", hint)
    return None


def trusted(event: Event) -> bool:
    """The driver's own report, or a job's report some other evidence corroborated."""
    return event.source != "output" or "cordoned" in event.action


_NAMED_PACKAGE = linear(r"^environment build failed: package '([^']+)'")


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


def launch_failure(lines: list[Line], ending: Ending) -> Diagnosis | None:
    """The agent could not start the command at all (`[hangar] could not start 'python': …`)."""
    line = next((x for x in lines if x.stream == "system" and _COULD_NOT_START.match(x.text)), None)
    if line is None:
        return None
    match = _COULD_NOT_START.match(line.text)
    what = match["what"].strip("'\"")
    summary = f"the job could not be started: {strip(line.text).removeprefix('[hangar] ')}"
    if what == "the job":  # the agent's own check (agent/reach.py, the sandbox): its text says what to change
        return Diagnosis(ENVIRONMENT, summary, match["error"][:500], "high", line.rank, [ref(line)])
    if "No such file" in match["error"]:
        hint = not_found_hint(what.rsplit("/", 1)[-1]) if "/" not in what else (
            f"{what} does not exist on the node as the job sees it: build the environment where job uids can reach "
            "it (outside /root and /tmp), or use a Hangar environment (requirements)")  # fmt: skip
    else:
        hint = (
            f"The job's uid may not run {what} ({match['error']}): use an interpreter or program job uids can run "
            "(outside /root and other private homes), or a Hangar environment (requirements)"
        )
    return Diagnosis(ENVIRONMENT, summary, hint, "high", line.rank, [ref(line)])


def by_exit_status(by_rank: dict[int, list[Line]], ending: Ending, exits: Mapping[int, RankExit],
                   order: list[int]) -> Diagnosis:  # fmt: skip
    """Nothing recognised in the output: what the exit status says; a message the program printed
    before it stopped itself; else `unknown` with the last errors."""
    first = order[0] if order else None
    code = ending.exit_code if ending.exit_code is not None or first is None else exits[first].code
    lines = [x for rank_lines in by_rank.values() for x in rank_lines]
    last = last_error_lines(lines)
    evidence = [ref(x) for x in last]
    if (by_signal := exit_signal_diagnosis(code, lines, ending, evidence)) is not None:
        return by_signal
    rank = first if first is not None else (0 if ending.world_size == 1 else None)
    if code in (126, 127) and not last:
        what = "not found (127)" if code == 127 else "not executable (126)"
        hint = "The command's program could not be run: check its path, and that the job's uid may run it"
        return Diagnosis(ENVIRONMENT, f"exited with code {code}: the command was {what}", hint, "medium", rank)
    if code and code < 128 and rank is not None:
        rank_lines = by_rank.get(rank, [])
        message = last_message(rank_lines, scanned_skip(rank_lines))
        if message is not None:
            said = strip(message.text).strip()[:300]
            summary = f"exited with code {code} after its own message: {said}"
            hint = f"The program stopped itself with this message: {said}: do what it says, then submit again"
            return Diagnosis(SCRIPT_EXIT, summary, hint, "medium", rank, [ref(message)])
    status = f"exited with code {code}" if code is not None else (ending.reason or "ended")
    summary = f"{status}; no known error in its output" + (f" (last: {strip(last[-1].text)[:160]})" if last else "")
    hint = "Nothing in the output names the cause: read the last error lines (evidence) and the log around them"
    return Diagnosis(UNKNOWN, summary, hint, "low", last[-1].rank if last else None, evidence)


def exit_signal_diagnosis(
    code: int | None, lines: list[Line], ending: Ending, evidence: list[dict]
) -> Diagnosis | None:
    """A process killed by a signal, and nothing in its output to say more. A stop Hangar sent
    (SIGTERM, then SIGKILL) ends the attempt as other than the user's and is said by its ending."""
    number = code - 128 if code is not None and code > 128 else None
    if number == signal.SIGABRT:
        found = abort_signal(None, lines, ending)
    elif number == signal.SIGSEGV:
        found = killed_signal(number, f"killed by SIGSEGV (exit code {code})", Line(0, ""), (), ending)
    elif number is not None and ending.failure_class == "user":
        how = f"killed by {signal_name(number)} (exit code {code}) that Hangar did not send"
        found = killed_signal(number, how, Line(0, ""), (), ending)
    else:
        return None
    if found is None:
        return None
    return Diagnosis(found.category, found.summary, found.hint, found.confidence, None, evidence)


def last_error_lines(lines: list[Line], count: int = 5) -> list[Line]:
    errors = [x for x in lines if x.stream == "stderr"] or [x for x in lines if x.stream != "system"]
    return errors[-count:]
