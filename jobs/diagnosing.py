"""Loading and saving around the pure diagnosis (jobs/diagnosis/).

When an attempt ends badly (`Attempt.finish`), its diagnosis is computed once
the end is committed and stored on the attempt (`Attempt.diagnosis`), then put
on the job's MLflow run as tags. Its inputs: the lines (each rank's head and
tail, the first errors), the ending, each rank's exit as recorded in
`Attempt.rank_status`, health events, and, only when a traceback ran code
through exec (`File "<string>"`), the files it may have run, read from the
job's code snapshot. `check_hangs` (run by the reconciler) flags a running
attempt whose ranks went silent.
"""

import logging
import tarfile
import time
from collections.abc import Iterator

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.dispatch import receiver
from django.utils import timezone

from hangar import tarballs
from jobs import diagnosis
from jobs.models import STARTED_ATTEMPT_STATES, Attempt, AttemptState, FailureClass, JobEvent, LogLine, Stream
from jobs.signals import attempt_finished

log = logging.getLogger("hangar.diagnosis")

TAIL_PER_RANK = 300  # the last lines of each rank: where a rank's error usually is
HEAD_PER_RANK = 200  # and its first: where a loss that turned NaN early, or a bad start, shows
ERRORS = 300  # plus the attempt's first error and fault lines: where the first failure usually is
STREAMS = {Stream.SYSTEM: "system", Stream.STDOUT: "stdout", Stream.STDERR: "stderr"}


@receiver(attempt_finished)
def _after_a_failed_attempt(sender, attempt, **kwargs) -> None:
    if attempt.state != AttemptState.SUCCEEDED:  # why it failed, once its end is committed
        diagnose_after_commit(attempt.pk)


def diagnose_after_commit(attempt_id: int) -> None:
    transaction.on_commit(lambda: store(attempt_id))


def store(attempt_id: int) -> dict | None:
    """Diagnose an ended attempt and store the result; never raises (a diagnosis is an aid)."""
    try:
        attempt = Attempt.objects.select_related("job", "node").filter(pk=attempt_id).first()
        if attempt is None or attempt.state in STARTED_ATTEMPT_STATES or attempt.state == AttemptState.SUCCEEDED:
            return None
        lines, end = load_lines(attempt), ending(attempt)
        files = job_files(attempt.job, diagnosis.wanted_files(lines, end.command))
        found = diagnosis.diagnose(lines, end, health_events(attempt), rank_exits(attempt), files).as_json()
        for key in ("hang_suspected", "straggler"):
            if key in attempt.diagnosis:
                found[key] = attempt.diagnosis[key]
        Attempt.objects.filter(pk=attempt_id).update(diagnosis=found)
    except Exception:
        log.exception("attempt %s: no diagnosis", attempt_id)
        return None
    from jobs import tracking

    tracking.tag_diagnosis(attempt.job_id, found)
    return found


def load_lines(attempt: Attempt) -> list[diagnosis.Line]:
    lines = LogLine.objects.filter(job_id=attempt.job_id, attempt_id=attempt.pk)
    wanted: dict[int, dict] = {}
    errors = lines.filter(Q(severity__gte=40) | Q(fault=True)).order_by("seq")[:ERRORS]
    for row in errors.values("seq", "rank", "stream", "text", "node__name"):
        wanted[row["seq"]] = row
    for rank in range(len(attempt.ranks)):
        mine = lines.filter(rank=rank)  # by rank_seq: the (attempt, rank, rank_seq) index, both ends
        for part in (mine.order_by("rank_seq")[:HEAD_PER_RANK], mine.order_by("-rank_seq")[:TAIL_PER_RANK]):
            for row in part.values("seq", "rank", "stream", "text", "node__name"):
                wanted[row["seq"]] = row
    return [
        diagnosis.Line(r["seq"], r["text"], r["rank"], r["node__name"] or "", STREAMS.get(r["stream"], ""), attempt.pk)
        for r in (wanted[s] for s in sorted(wanted))
    ]


def ending(attempt: Attempt) -> diagnosis.Ending:
    return diagnosis.Ending(
        state=attempt.state,
        failure_class=attempt.failure_class,
        exit_code=attempt.exit_code,
        reason=utf8(attempt.reason),
        world_size=len(attempt.ranks),
        max_runtime_seconds=attempt.job.max_runtime_seconds,
        memory_limit_mb=settings.HANGAR_JOB_MEMORY_LIMIT_MB,
        command=tuple(utf8(str(x)) for x in attempt.job.command or ()),
    )


def utf8(text: str) -> str:
    """Text the recognisers (RE2, which reads UTF-8) can read: JSON lets a command carry a lone
    surrogate, which has no UTF-8."""
    return text.encode("utf-8", "replace").decode()


def rank_exits(attempt: Attempt) -> dict[int, diagnosis.RankExit]:
    """Each rank's exit as its agent recorded it in `rank_status`: `{"exit", "at", "stopped"}` per
    rank; 0 alone for a rank that succeeded; None for one still running (or never recorded)."""
    out = {}
    for rank, status in (attempt.rank_status or {}).items():
        if isinstance(status, dict) and "exit" in status:
            at = status.get("at")
            out[int(rank)] = diagnosis.RankExit(status["exit"], float(at) if at is not None else None,
                                                bool(status.get("stopped")))  # fmt: skip
        elif status == 0:
            out[int(rank)] = diagnosis.RankExit(0)
    return out


FILE_BYTES = 256 * 1024  # a config or script; a larger file is no source the diagnosis quotes


def job_files(job, wanted: list[str]) -> dict[str, str]:
    """The `wanted` files (relative paths) from the job's code snapshot, as text; {} without one.
    Read from the stored tar.gz through the same bounded reader the agent unpacks with."""
    if not wanted or job.snapshot_id is None:
        return {}
    snapshot = job.snapshot
    names = {name.removeprefix("./") for name in wanted[:8]}
    out: dict[str, str] = {}
    limit = tarballs.stream_limit(snapshot.unpacked_size, snapshot.files)
    try:
        with tarballs.opened(Chunks(snapshot.chunks()), limit) as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if name in names and member.isfile() and member.size <= FILE_BYTES:
                    out[name] = tar.extractfile(member).read().decode(errors="replace")
                    if len(out) == len(names):
                        break
    except (tarballs.SnapshotRefused, tarfile.TarError, OSError) as exc:  # the diagnosis goes on without them
        log.warning("job %s: its snapshot's files could not be read for the diagnosis: %s", job.pk, exc)
    return out


class Chunks:
    """A snapshot's stored pieces as the file-like object tarballs.opened reads."""

    def __init__(self, pieces: Iterator[bytes]):
        self.pieces, self.piece, self.at = pieces, b"", 0

    def read(self, size: int = -1) -> bytes:
        if self.at >= len(self.piece):
            self.piece, self.at = next(self.pieces, b""), 0
        end = len(self.piece) if size < 0 else self.at + size
        out = self.piece[self.at : end]
        self.at += len(out)
        return out


def health_events(attempt: Attempt) -> list[diagnosis.Event]:
    from fleet.models import HealthEvent

    nodes = [r["node_id"] for r in attempt.ranks]
    since = attempt.started_at or attempt.scheduled_at
    rows = HealthEvent.objects.filter(node_id__in=nodes, at__gte=since).filter(
        Q(attempt_id=attempt.pk) | Q(attempt__isnull=True)
    )
    if attempt.finished_at is not None:
        rows = rows.filter(at__lte=attempt.finished_at)
    return [
        diagnosis.Event(e.kind, e.message, e.node.name, e.action, e.source, e.pk)
        for e in rows.select_related("node").order_by("at")[:50]
    ]


# --- hangs ------------------------------------------------------------------------------------


_next_check = 0.0


def check_hangs(now=None, force: bool = False) -> list[int]:
    """Flag running attempts with a rank silent for HANGAR_HANG_SECONDS while the others print (or all
    silent with idle GPUs), and multi-rank attempts with a straggler (a rank whose printed step lags
    the others'); stop hung ones whose job asks for it. Returns the attempts newly flagged hung.
    The reconciler calls it every pass; it looks at most ten times per HANGAR_HANG_SECONDS."""
    global _next_check
    if not force and time.monotonic() < _next_check:
        return []
    _next_check = time.monotonic() + settings.HANGAR_HANG_SECONDS / 10
    now = now or timezone.now()
    flagged = []
    running = Attempt.objects.filter(state=AttemptState.RUNNING).select_related("job")
    for attempt in running.exclude(diagnosis__has_keys=["hang_suspected", "straggler"]):
        last = last_lines(attempt)
        if "hang_suspected" not in attempt.diagnosis and (hang := hang_of(attempt, now, last)) is not None:
            if flag(attempt, "hang_suspected", hang.ranks, hang.summary, now):
                flagged.append(attempt.pk)
                if attempt.job.stop_on_hang:
                    stop_hung(attempt, hang)
                continue
        if "straggler" not in attempt.diagnosis and (lag := straggler_of(last)) is not None:
            flag(attempt, "straggler", lag.ranks, lag.summary, now)
    return flagged


def last_lines(attempt: Attempt) -> dict[int, tuple[float, str]]:
    """Each rank's last line of output (time, text), from the (attempt, rank, rank_seq) index: no
    scan of a long log."""
    out = {}
    for rank in range(len(attempt.ranks)):
        rows = LogLine.objects.filter(attempt_id=attempt.pk, rank=rank).exclude(stream=Stream.SYSTEM)
        row = rows.order_by("-rank_seq").values_list("ts", "text").first()
        if row is not None:
            out[rank] = (row[0].timestamp(), row[1])
    return out


def hang_of(attempt: Attempt, now, last: dict[int, tuple[float, str]]) -> diagnosis.Hang | None:
    seconds = settings.HANGAR_HANG_SECONDS
    started = attempt.running_at or attempt.started_at
    if started is None or (now - started).total_seconds() < seconds:
        return None
    stamps = {rank: ts for rank, (ts, _) in last.items()}
    return diagnosis.hang_suspected(
        stamps, now.timestamp(), started.timestamp(), seconds, len(attempt.ranks), gpus_idle(attempt)
    )


def straggler_of(last: dict[int, tuple[float, str]]) -> diagnosis.Hang | None:
    steps = {rank: step for rank, (_, text) in last.items() if (step := diagnosis.step_of(text)) is not None}
    return diagnosis.straggling(steps)


def gpus_idle(attempt: Attempt) -> bool | None:
    """Whether every GPU of the attempt is idle per its latest telemetry; None when unknown."""
    from fleet.models import GPU

    values = []
    for placement in attempt.ranks:
        rows = GPU.objects.filter(node_id=placement["node_id"], index__in=placement["gpus"])
        values += list(rows.values_list("utilization_pct", flat=True))
    if not values or any(v is None for v in values):
        return None
    return all(v < 5 for v in values)


def flag(attempt: Attempt, key: str, ranks: tuple[int, ...], summary: str, now) -> bool:
    """Note a flag (hang_suspected, straggler) on the running attempt once, with a job event."""
    note = {"ranks": list(ranks), "summary": summary, "at": now.isoformat()}
    with transaction.atomic():
        row = Attempt.objects.select_for_update().filter(pk=attempt.pk, state=AttemptState.RUNNING).first()
        if row is None or key in row.diagnosis:
            return False
        Attempt.objects.filter(pk=attempt.pk).update(diagnosis={**row.diagnosis, key: note})
        JobEvent.objects.create(job_id=attempt.job_id, attempt=attempt, kind=key, message=summary)
    attempt.diagnosis = {**attempt.diagnosis, key: note}
    log.warning("attempt %s of job %s: %s: %s", attempt.number, attempt.job_id, key, summary)
    return True


def stop_hung(attempt: Attempt, hang: diagnosis.Hang) -> None:
    """The job asked for it: end the attempt as the job's own failure. Its ranks' runners find it
    ended at their next check and stop their processes (SIGTERM, grace, SIGKILL)."""
    reason = f"{diagnosis.HANG_STOP}: {hang.summary} (stop_on_hang)"
    attempt.finish(AttemptState.FAILED, FailureClass.USER, reason)


def wait_for(attempt_id: int, timeout: float = 10.0) -> dict:
    """For tests and benches: the stored diagnosis of an attempt, once there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = Attempt.objects.filter(pk=attempt_id).values_list("diagnosis", flat=True).first() or {}
        if "category" in found:
            return found
        time.sleep(0.1)
    return {}
