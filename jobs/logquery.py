"""Filters over a job's log lines, shared by the API, the download and the websocket.

A filter is parsed from query parameters (or a websocket subscribe message)
into a LogFilter, which narrows a LogLine queryset in the database and finds
the spans of text to highlight.
"""

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta

from django.db.models import Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from jobs.models import LogLine, Severity

MAX_PATTERN = 500
MAX_SPANS = 50
SEVERITY_NAMES = {s.label: s.value for s in Severity} | {"WARN": Severity.WARNING, "FATAL": Severity.CRITICAL}
FILTER_PARAMS = ("attempt", "node", "rank", "severity", "since", "until", "last_minutes", "q", "regex")


class LogFilterError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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
        since = _time(get("since"), "since")
        if minutes := get("last_minutes"):
            number = _number(minutes, "last_minutes", float)
            if number <= 0:
                raise LogFilterError("last_minutes", "must be a positive number of minutes, e.g. 15")
            since = max(since or datetime.min.replace(tzinfo=UTC), timezone.now() - timedelta(minutes=number))
        text, regex = get("q"), get("regex").lower() in ("1", "true", "yes", "on")
        if len(text) > MAX_PATTERN:
            raise LogFilterError("q", f"is {len(text)} characters long; use at most {MAX_PATTERN}")
        if regex:
            try:
                re.compile(text)
            except re.error as exc:
                raise LogFilterError("q", f"is not a valid regular expression ({exc}); or search plain text: regex=0")
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

    def apply(self, lines: QuerySet) -> QuerySet:
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
        if self.text:
            # Plain text as an escaped case-insensitive regex: PostgreSQL's `~*` can use the
            # trigram index on text, where Django's icontains (UPPER(text) LIKE) cannot.
            lines = lines.filter(text__iregex=self.text if self.regex else re.escape(self.text))
        return lines

    def lines_after(self, job_id: int, cursor: tuple[int, int]) -> QuerySet:
        return self.apply(LogLine.after(job_id, *cursor))

    def pattern(self) -> re.Pattern | None:
        if not self.text:
            return None
        return re.compile(self.text if self.regex else re.escape(self.text), re.IGNORECASE)

    def as_dict(self) -> dict:
        """The filter as the client should show it back (times in ISO 8601)."""
        out = asdict(self)
        out["nodes"], out["ranks"] = list(self.nodes), list(self.ranks)
        out["min_severity"] = Severity(self.min_severity).label if self.min_severity else None
        out["since"] = self.since.isoformat() if self.since else None
        out["until"] = self.until.isoformat() if self.until else None
        return out


def highlights(pattern: re.Pattern | None, text: str) -> list[list[int]]:
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
        value = kind(raw)
    except ValueError:
        raise LogFilterError(field, f"must be a number, got {raw!r}")
    if value < 0:
        raise LogFilterError(field, "must not be negative")
    return value


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

    With fewer than `limit` matches the cursor moves past every line stored
    when the read began (its high-water mark), matching or not, so a filtered
    follower does not scan the same non-matching lines again.
    """
    high = LogLine.high_water(job_id)
    lines = list(log_filter.lines_after(job_id, cursor)[:limit])
    if len(lines) == limit:
        return lines, (lines[-1].attempt_id, lines[-1].seq), True
    last = (lines[-1].attempt_id, lines[-1].seq) if lines else cursor
    return lines, max(last, high, cursor), False


def first_error(job_id: int, skip_attempts=()) -> LogLine | None:
    """The earliest line at ERROR or worse, or naming a fault, of the job's attempts not in `skip_attempts`."""
    errors = LogLine.objects.filter(job_id=job_id).filter(Q(severity__gte=Severity.ERROR) | Q(fault=True))
    return errors.exclude(attempt_id__in=skip_attempts).order_by("attempt_id", "seq").first()
