"""The typed shapes of live messages, shared by their senders and the consumers.

Channel-layer messages are hints only: the lines themselves are stored first
and read back from the database from the client's cursor, so a dropped hint
delays a line by one poll interval and never loses it.
"""

from typing import Literal, TypedDict


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


class LogAppendedHint(TypedDict):
    """Agent -> consumers of a job's group: new lines are stored up to `seq`."""

    type: Literal["log.appended"]
    attempt: int
    seq: int


class WireLine(TypedDict):
    attempt: int
    seq: int
    ts: str
    node: str | None
    rank: int
    stream: str
    severity: str
    text: str


class Cursor(TypedDict):
    attempt: int
    seq: int


class LinesMessage(TypedDict):
    """Server -> browser/CLI: a batch of lines in order, and the cursor after the last one."""

    type: Literal["lines"]
    lines: list[WireLine]
    cursor: Cursor


class StateMessage(TypedDict):
    """Server -> browser/CLI: the job's state changed. `final` is sent once all lines were sent."""

    type: Literal["state"]
    state: str
    attempt_state: str | None
    exit_code: int | None
    final: bool


def wire_lines(lines) -> list[WireLine]:
    """Stored LogLine rows in the shape the API and the websocket send."""
    from fleet.models import Node
    from jobs.models import Severity, Stream

    names = dict(Node.objects.filter(pk__in={line.node_id for line in lines}).values_list("pk", "name"))
    return [
        {
            "attempt": line.attempt_id,
            "seq": line.seq,
            "ts": line.ts.isoformat(),
            "node": names.get(line.node_id),
            "rank": line.rank,
            "stream": Stream(line.stream).label,
            "severity": Severity(line.severity).label,
            "text": line.text,
        }
        for line in lines
    ]
