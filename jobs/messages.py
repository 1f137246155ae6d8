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


class WireLine(TypedDict, total=False):
    attempt: int  # the attempt's id: cursors are (attempt id, seq)
    attempt_number: int
    seq: int
    ts: str
    node: str | None
    rank: int
    stream: str
    severity: str
    fault: bool
    text: str
    hl: list[list[int]]  # [start, end] of each match of the text filter, only when one is set


class Cursor(TypedDict):
    attempt: int
    seq: int


class SubscribeMessage(TypedDict, total=False):
    """Browser/CLI -> server: (re)start the stream with these filters, after this cursor."""

    type: Literal["subscribe"]
    filters: dict
    cursor: Cursor


class SubscribedMessage(TypedDict):
    """Server -> browser/CLI: the subscription `sub` is active with these (normalised) filters."""

    type: Literal["subscribed"]
    sub: int
    filters: dict
    cursor: Cursor


class LinesMessage(TypedDict):
    """Server -> browser/CLI: a batch of matching lines in order, and the cursor to resume from.

    `lines` may be empty when only the cursor moved (lines were stored that do not match)."""

    type: Literal["lines"]
    sub: int
    lines: list[WireLine]
    cursor: Cursor


class FirstErrorMessage(TypedDict):
    """Server -> browser/CLI: the first line at ERROR or worse, or naming a GPU/NCCL fault, of an attempt."""

    type: Literal["first_error"]
    sub: int
    line: WireLine
    telemetry_url: str | None


class ErrorMessage(TypedDict):
    """Server -> browser/CLI: a subscribe message was refused; the field names what to change."""

    type: Literal["error"]
    field: str
    message: str


class StateMessage(TypedDict):
    """Server -> browser/CLI: the job's state changed. `final` is sent once all lines were sent."""

    type: Literal["state"]
    state: str
    attempt_state: str | None
    exit_code: int | None
    final: bool


def telemetry_url(line: WireLine) -> str | None:
    """The node's GPU telemetry page at the moment of a line."""
    if not line.get("node"):
        return None
    from urllib.parse import quote

    return f"/fleet/nodes/{quote(line['node'])}/?at={quote(line['ts'])}"
