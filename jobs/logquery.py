"""Filters over a job's log lines, shared by the API, the download and the websocket.

A filter is parsed from query parameters (or a websocket subscribe message)
into a LogFilter, which narrows a LogLine queryset in the database and finds
the spans of text to highlight.
"""

import re
import re._constants as re_constants
import re._parser as re_parser
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta

import re2
from django.conf import settings
from django.db import DataError, OperationalError, connection, connections, transaction
from django.db.models import BooleanField, Func, Q, QuerySet, Value
from django.db.models.functions import Lower
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from fleet.models import Node
from jobs.messages import WireLine
from jobs.models import Attempt, LogLine, Severity, Stream
from portal.inputs import InputError, check_text, real_number, whole_number
from portal.patterns import PatternError, compile_user_pattern

MAX_SPANS = 50
MAX_MINUTES = 100 * 366 * 24 * 60  # last_minutes: a century is "everything"
SEVERITY_NAMES = {s.label: s.value for s in Severity} | {"WARN": Severity.WARNING, "FATAL": Severity.CRITICAL}
FILTER_PARAMS = ("attempt", "node", "rank", "severity", "since", "until", "last_minutes", "q", "regex")
# Lines of one window of the ordered walk: about 0.1-0.2 s of filtering on PostgreSQL.
WALK_WINDOW = 100_000
WALK_WINDOW_MIN = 1_000
# What a reader of lines needs (wire_lines), as read_page returns them.
ROW_FIELDS = ("attempt_id", "seq", "node_id", "rank", "stream", "severity", "fault", "ts", "text")
QUERY_CANCELED = "57014"  # PostgreSQL's SQLSTATE for a statement cancelled by statement_timeout
INVALID_REGEX = "2201B"  # PostgreSQL's SQLSTATE for a regular expression it cannot compile


class LogFilterError(InputError):
    """A filter refused, naming its field: a 400 wherever it is raised in a view (portal.api.errors)."""


@dataclass(frozen=True)
class LogFilter:
    attempt: int | None = None  # the attempt's number within its job (1, 2, ...)
    nodes: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    min_severity: int | None = None
    since: datetime | None = None
    until: datetime | None = None
    text: str = ""
    regex: bool = False

    @classmethod
    def parse(cls, params: Mapping) -> "LogFilter":
        """From query parameters or a JSON object; raises LogFilterError naming the field."""
        get = _getter(params)
        try:  # a websocket's filters come in JSON, past InputMiddleware
            for name in FILTER_PARAMS:
                check_text(get(name), name)
        except InputError as exc:
            raise LogFilterError(exc.field, exc.message)
        since = _time(get("since"), "since")
        if minutes := get("last_minutes"):
            number = _number(minutes, "last_minutes", float)
            if number <= 0:
                raise LogFilterError("last_minutes", "must be a positive number of minutes, e.g. 15")
            since = max(since or datetime.min.replace(tzinfo=UTC), timezone.now() - timedelta(minutes=number))
        text, regex = get("q"), get("regex").lower() in ("1", "true", "yes", "on")
        try:
            compile_user_pattern(text, "q", regex)
        except PatternError as exc:
            raise LogFilterError(exc.field, exc.message)
        return cls(
            attempt=_number(get("attempt"), "attempt", int) if get("attempt") else None,
            nodes=tuple(name for name in get("node").split(",") if name.strip()),
            ranks=tuple(_number(r, "rank", int) for r in get("rank").split(",") if r.strip()),
            min_severity=_severity(get("severity")),
            since=since,
            until=_time(get("until"), "until"),
            text=text,
            regex=regex,
        )

    def apply(self, lines: QuerySet, prefilter: bool = False) -> QuerySet:
        """`lines` narrowed by the filter. `prefilter`: a regex is preceded by a LIKE that
        every match passes (like_prefilter), for scans that test line after line; it is
        left out of other queries, where it would only make the planner's row estimate
        (the two conditions' selectivities multiplied) even smaller than it is."""
        if self.attempt is not None:
            lines = lines.filter(attempt__number=self.attempt)
        if self.nodes:
            lines = lines.filter(node__name__in=self.nodes)
        if self.ranks:
            lines = lines.filter(rank__in=self.ranks)
        if self.min_severity is not None:
            lines = lines.filter(severity__gte=self.min_severity)
        if self.since is not None:
            lines = lines.filter(ts__gte=self.since)
        if self.until is not None:
            lines = lines.filter(ts__lte=self.until)
        if self.text and connections[lines.db].vendor == "postgresql":
            # Both forms use the trigram index on lower(text) (migration 0008). Plain text is
            # a LIKE on lower(text): about 0.3 us a line where a regex costs 4 us.
            lines = lines.alias(text_lower=Lower("text"))
            if self.regex:
                # A LIKE every match passes is tested first: most lines fail it for a tenth
                # of the regex's cost.
                if prefilter and (like := like_prefilter(self.text)):
                    lines = lines.filter(Like(Lower("text"), Value(like)))
                lines = lines.filter(text_lower__iregex=self.text)
            else:
                lines = lines.filter(text_lower__contains=self.text.lower())
        elif self.text:
            # SQLite: REGEXP runs on RE2 (portal.patterns), whose case folding is Unicode's
            # (SQLite's LIKE folds ASCII only).
            lines = lines.filter(text__iregex=self.text if self.regex else re2.escape(self.text))
        return lines

    def lines_after(self, job_id: int, cursor: tuple[int, int]) -> QuerySet:
        return self.apply(LogLine.after(job_id, *cursor))

    def pattern(self):
        """The text filter compiled by RE2 (linear time), for highlighting; None without one."""
        if not self.text:
            return None
        return compile_user_pattern(self.text, "q", self.regex)

    def as_dict(self) -> dict:
        """The filter as the client should show it back (times in ISO 8601)."""
        out = asdict(self)
        out["nodes"], out["ranks"] = list(self.nodes), list(self.ranks)
        out["min_severity"] = Severity(self.min_severity).label if self.min_severity else None
        out["since"] = self.since.isoformat() if self.since else None
        out["until"] = self.until.isoformat() if self.until else None
        return out


# Characters that mean themselves in Python's and PostgreSQL's regular expressions alike.
PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 =:,;/@#%&'\"<>!~`_-.")


class Like(Func):
    """`lhs LIKE pattern` with the pattern's wildcards kept (Django's lookups escape them)."""

    template = "%(expressions)s"
    arg_joiner = " LIKE "
    output_field = BooleanField()


def like_prefilter(pattern: str) -> str:
    """A LIKE pattern that every line the regex matches also matches, or "" when none helps.

    Built from the longest stretch at the regex's top level (not inside groups or
    alternatives, not under a repeat) of plain ASCII characters, which both regex
    dialects take literally, and `.` (any character: LIKE's `_`). Lowercased, for
    lower(text). At least three plain characters, or it would not narrow anything.
    """
    try:
        parsed = re_parser.parse(pattern)
    except re.error:
        return ""
    if any(op is re_constants.BRANCH for op, _ in parsed.data):
        return ""
    best, run = [], []
    for op, value in parsed.data:
        if op is re_constants.LITERAL and chr(value) in PLAIN:
            run.append(chr(value).lower())
        elif op is re_constants.ANY:
            run.append(None)
        else:
            run = []
            continue
        if sum(c is not None for c in run) > sum(c is not None for c in best):
            best = list(run)
    while best and best[0] is None:
        best.pop(0)
    if sum(c is not None for c in best) < 3:
        return ""
    escaped = ("_" if c is None else "\\" + c if c in "%_\\" else c for c in best)
    return "%" + "".join(escaped) + "%"


def highlights(pattern, text: str) -> list[list[int]]:
    """[start, end] of each match of the text filter in a line, for highlighting."""
    if pattern is None:
        return []
    spans = []
    for match in pattern.finditer(text):
        if match.end() > match.start():
            spans.append([match.start(), match.end()])
            if len(spans) == MAX_SPANS:
                break
    return spans


def _getter(params: Mapping):
    def get(name: str) -> str:
        value = params.get(name)
        if value is None:
            return ""
        if isinstance(value, list | tuple):
            return ",".join(str(v) for v in value)
        if isinstance(value, bool):
            return "1" if value else ""
        return str(value).strip() if name != "q" else str(value)

    return get


def _number(raw: str, field: str, kind):
    try:
        if kind is float:
            return real_number(raw, field, maximum=MAX_MINUTES)
        return whole_number(raw, field, maximum=2**31 - 1)
    except InputError as exc:
        raise LogFilterError(exc.field, exc.message)


def _severity(raw: str) -> int | None:
    if not raw:
        return None
    if raw.upper() in SEVERITY_NAMES:
        return SEVERITY_NAMES[raw.upper()]
    names = ", ".join(s.label for s in Severity)
    raise LogFilterError("severity", f"{raw!r} is not a severity; use one of {names} (the minimum level shown)")


def _time(raw: str, field: str) -> datetime | None:
    if not raw:
        return None
    try:
        value = parse_datetime(raw)
    except ValueError:
        value = None
    if value is None:
        raise LogFilterError(field, f"{raw!r} is not a time; use ISO 8601, e.g. 2026-11-29T12:00:00Z")
    return value if timezone.is_aware(value) else value.replace(tzinfo=UTC)


def read_page(job_id: int, log_filter: LogFilter, cursor: tuple[int, int], limit: int):
    """Up to `limit` matching lines after the cursor, the cursor to resume from, and whether more are waiting.

    Lines are rows with LogLine's attribute names (ROW_FIELDS), not model instances:
    a replay reads tens of thousands a second, and building models was most of it.

    With fewer than `limit` matches the cursor moves past every line stored
    when the read began (its high-water mark), matching or not, so a filtered
    follower does not scan the same non-matching lines again.

    On PostgreSQL a filtered read is bounded: the planner's plan gets
    HANGAR_LOG_QUERY_TIMEOUT_MS. Its row estimates multiply the filters' selectivities
    as if they were independent, and a text search that is rare in the table but
    common among the job's errors (or absent among one rank's lines) can send it down
    a scan of millions of rows. Such a read is cancelled and the page is read by
    walking the lines in order instead, window by window (see _walk): then a page may
    come back short, or empty, with `more` set and the cursor at how far it got.
    """
    high = LogLine.high_water(job_id)
    if high <= cursor:
        return [], cursor, False
    query = log_filter.lines_after(job_id, cursor).values_list(*ROW_FIELDS, named=True)[:limit]
    if log_filter == LogFilter():
        lines = list(query)
    else:
        lines = bounded(query)
        if lines is None:
            return _walk(job_id, log_filter, cursor, high, limit)
    if len(lines) == limit:
        return lines, (lines[-1].attempt_id, lines[-1].seq), True
    last = (lines[-1].attempt_id, lines[-1].seq) if lines else cursor
    return lines, max(last, high, cursor), False


def bounded(query: QuerySet, in_order: bool = False, timeout_ms: int | None = None) -> list | None:
    """The query's rows, read under a statement timeout on PostgreSQL; None when it was cancelled.

    `timeout_ms`: HANGAR_LOG_QUERY_TIMEOUT_MS by default, 0 for none.
    `in_order`: no bitmap scans, so a window of the walk is read along the cursor
    index (a cost bounded by its size), not through a trigram index over the whole
    table. The settings hold for the read's own transaction (or savepoint) only;
    elsewhere (SQLite) the query runs as it is.
    """
    if connection.vendor != "postgresql":
        return list(query)
    timeout = f"{settings.HANGAR_LOG_QUERY_TIMEOUT_MS if timeout_ms is None else timeout_ms}ms"
    bitmaps = "off" if in_order else "on"
    # Local settings last to the end of the transaction: in a transaction of the caller's
    # they are put back after the read; otherwise the read's own commit ends them.
    nested = connection.in_atomic_block
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT current_setting('statement_timeout'), current_setting('enable_bitmapscan'),"
                    " set_config('statement_timeout', %s, true), set_config('enable_bitmapscan', %s, true)",
                    [timeout, bitmaps],
                )
                before = cursor.fetchone()[:2]
            rows = list(query)
            if nested:
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT set_config('statement_timeout', %s, true), set_config('enable_bitmapscan', %s, true)",
                        before,
                    )
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == QUERY_CANCELED:
            return None
        raise
    except DataError as exc:
        # RE2 accepted the pattern (portal.patterns) but PostgreSQL's dialect has no such syntax.
        if getattr(exc.__cause__, "sqlstate", None) == INVALID_REGEX:
            raise LogFilterError("q", f"PostgreSQL cannot run this regular expression ({exc.__cause__}); simplify it")
        raise
    return rows


def _walk(job_id: int, log_filter: LogFilter, cursor: tuple[int, int], high: tuple[int, int], limit: int):
    """read_page's fallback: the lines after the cursor in order, in windows of seq, within a time budget.

    Each window is a range of the job's cursor index, so its cost is bounded by its
    size whatever the filter; a window that still overruns the timeout is halved, one
    that takes under a quarter of it is doubled. Lines of attempts before the
    high-water mark's are all stored, and the last attempt is read only up to the
    mark, so the returned cursor never passes an unstored line.
    """
    deadline = time.monotonic() + settings.HANGAR_LOG_PAGE_BUDGET_MS / 1000
    found: list = []
    position, window = cursor, WALK_WINDOW
    attempts = Attempt.objects.filter(job_id=job_id, pk__gte=cursor[0], pk__lte=high[0]).order_by("pk")
    for attempt_id in attempts.values_list("pk", flat=True):
        start = cursor[1] if attempt_id == cursor[0] else 0
        end = high[1] if attempt_id == high[0] else LogLine.high_water(job_id, attempt_id)[1]
        while start < end:
            if position != cursor and time.monotonic() >= deadline:
                return found, position, True
            stop = min(start + window, end)
            span = LogLine.objects.filter(job_id=job_id, attempt_id=attempt_id, seq__gt=start, seq__lte=stop)
            page = log_filter.apply(span, prefilter=True).order_by("attempt_id", "seq")
            page = page.values_list(*ROW_FIELDS, named=True)[: limit - len(found)]
            # The smallest window runs to its end: a walk always makes progress.
            began = time.monotonic()
            lines = bounded(page, in_order=True, timeout_ms=None if window > WALK_WINDOW_MIN else 0)
            if lines is None:
                window = max(WALK_WINDOW_MIN, window // 2)
                continue
            if (time.monotonic() - began) * 1000 < settings.HANGAR_LOG_QUERY_TIMEOUT_MS / 4:
                window *= 2  # cheap windows (an index narrows them, e.g. to errors): take bigger steps
            found.extend(lines)
            if len(found) == limit:
                return found, (attempt_id, found[-1].seq), True
            start = stop
            position = (attempt_id, stop)
    return found, max(position, high), False


def first_error(job_id: int, skip_attempts=()) -> LogLine | None:
    """The earliest line at ERROR or worse, or naming a fault, of the job's attempts not in `skip_attempts`.

    One probe of the partial error index per attempt, in order: a single query
    excluding the skipped attempts would read past every error of theirs (100,000
    errors in a 10-million-line attempt: 0.4 s, once per websocket batch).
    """
    attempts = Attempt.objects.filter(job_id=job_id).exclude(pk__in=skip_attempts).order_by("pk")
    errors = LogLine.objects.filter(job_id=job_id).filter(Q(severity__gte=Severity.ERROR) | Q(fault=True))
    for attempt_id in attempts.values_list("pk", flat=True):
        if (line := errors.filter(attempt_id=attempt_id).order_by("seq").first()) is not None:
            return line
    return None


def wire_lines(lines, pattern=None) -> list[WireLine]:
    """Stored lines (LogLine rows, or read_page's named rows) in the shape the API and the
    websocket send; `hl` when a text filter is set."""
    names = dict(Node.objects.filter(pk__in={line.node_id for line in lines}).values_list("pk", "name"))
    numbers = dict(Attempt.objects.filter(pk__in={line.attempt_id for line in lines}).values_list("pk", "number"))
    streams, severities = dict(Stream.choices), dict(Severity.choices)
    out: list[WireLine] = []
    for line in lines:
        wire: WireLine = {
            "attempt": line.attempt_id,
            "attempt_number": numbers.get(line.attempt_id),
            "seq": line.seq,
            "ts": line.ts.isoformat(),
            "node": names.get(line.node_id),
            "rank": line.rank,
            "stream": streams[line.stream],
            "severity": severities[line.severity],
            "fault": line.fault,
            "text": line.text,
        }
        if pattern is not None:
            wire["hl"] = highlights(pattern, line.text)
        out.append(wire)
    return out
