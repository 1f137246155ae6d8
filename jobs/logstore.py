"""Storing a batch of an attempt's log lines: numbered under the attempt's row lock (the
fence against an attempt that is no longer current), skipping lines already stored, so a
batch sent twice (from a node's spool after a lost acknowledgement) is stored once. The
agent's LogWriter (agent/output.py) calls it; so may anything that stores lines."""

import functools
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction

from jobs.models import STARTED_ATTEMPT_STATES, Attempt, LogLine
from portal import statements

COPY_MIN_ROWS = 64  # below this a multi-row INSERT is as fast as COPY
COPY_COLUMNS = (
    "job_id", "attempt_id", "node_id", "rank", "rank_seq", "seq", "stream", "severity", "fault", "ts", "text"
)  # fmt: skip


@dataclass(slots=True)
class NewLine:
    """A parsed line on its way to the database: a LogLine's fields, without the cost of a model instance."""

    job_id: int
    attempt_id: int
    node_id: int | None
    rank: int
    stream: int
    severity: int
    fault: bool
    ts: datetime
    text: str
    rank_seq: int  # the line's number in its rank's output, given by the writer: what makes a resend recognisable
    seq: int = 0

    def columns(self, ts) -> tuple:
        """The values for COPY_COLUMNS, with the timestamp as the database driver wants it."""
        fields = (self.job_id, self.attempt_id, self.node_id, self.rank, self.rank_seq, self.seq)
        return (*fields, self.stream, self.severity, self.fault, ts, self.text)


class AttemptNotCurrent(Exception):
    """The attempt ended (or was never started): its lines are refused."""


def store_lines(
    attempt_id: int, rows: list[NewLine], current_only: bool = True, fresh: bool = False, last: int | None = None
) -> int:
    """Number and insert one batch of an attempt's lines, skipping those already stored; returns the last seq.

    Raises AttemptNotCurrent when the attempt no longer takes lines: when it is
    not started (current_only, a live writer's fence) or does not exist.
    `fresh`: a batch never sent before (a live writer's first try), so none of it can be
    stored yet and the look for stored lines is skipped; a batch sent again after an
    error (its commit may have happened) is not fresh.
    `last`: the attempt's last seq, given by its only writer (a one-rank attempt's live
    writer, from what its own acknowledged batches returned), so it is not read again: a
    round trip less per batch. Were it wrong, the (job, attempt, seq) constraint refuses the
    batch, and the writer's retry (not fresh) reads it. A fresh batch with `last` on PostgreSQL,
    outside a transaction (a live writer's), is one statement (insert_if_started).
    """
    if (
        fresh
        and last is not None
        and current_only
        and 0 < len(rows) < COPY_MIN_ROWS
        and connection.vendor == "postgresql"
        and not connection.in_atomic_block  # in a caller's transaction: a savepoint, so a refused batch leaves it whole
    ):
        return insert_if_started(attempt_id, rows, last)
    with transaction.atomic():
        # FOR NO KEY UPDATE on PostgreSQL: writers of one attempt queue here, and an
        # attempt that is being ended waits for (or refuses) this batch.
        fence = started_attempt_locked if current_only else attempt_locked
        if not (job_id := fence.first(pk=attempt_id)):
            raise AttemptNotCurrent(attempt_id)
        if not fresh:
            rows = unstored(attempt_id, rows)
        if last is None:
            last = last_seq.first(job_id=job_id, attempt_id=attempt_id) or 0
        number(rows, last)
        if rows:
            insert_rows(rows)
    return last + len(rows)


def number(rows: list[NewLine], last: int) -> None:
    """Give the rows the attempt's line numbers after `last`, in order."""
    for offset, row in enumerate(rows, start=1):
        row.seq = last + offset


def insert_values(rows: list[NewLine]) -> list[tuple]:
    """Each row's values for COPY_COLUMNS, as an INSERT's parameters (the timestamp adapted)."""
    adapt = connection.ops.adapt_datetimefield_value
    return [row.columns(adapt(row.ts)) for row in rows]


def insert_if_started(attempt_id: int, rows: list[NewLine], last: int) -> int:
    """A live writer's batch in one statement, on PostgreSQL (store_lines' common case: nothing
    to skip, the last seq known): inserted only while the attempt is started, its row locked
    for the statement as store_lines' transaction locks it. The lock is taken and released on
    the server: an attempt's end never waits on the writer's next round trip, and the batch
    is one round trip instead of four (BEGIN, the fence, the insert, COMMIT)."""
    number(rows, last)
    values = [value for row in insert_values(rows) for value in row]
    with connection.cursor() as cursor:
        cursor.execute(fenced_insert(len(rows)), [*values, attempt_id, *STARTED_ATTEMPT_STATES])
        if cursor.rowcount != len(rows):
            raise AttemptNotCurrent(attempt_id)
    return last + len(rows)


@functools.cache
def fenced_insert(count: int) -> str:
    """INSERT ... SELECT of `count` rows that inserts none unless the attempt (the parameter after
    the rows') is in a started state (the last parameters), its row locked as store_lines' fence
    locks it: an end being written is waited for, then refuses the batch. Each value is cast to
    its column's type: a VALUES list's types are otherwise guessed from the parameters' (a NULL
    is text, which no integer column takes)."""
    fields = {field.column: field for field in LogLine._meta.concrete_fields}
    row = "(" + ", ".join(f"CAST(%s AS {fields[column].db_type(connection)})" for column in COPY_COLUMNS) + ")"
    states = ", ".join(["%s"] * len(STARTED_ATTEMPT_STATES))
    attempts = Attempt._meta.db_table
    return (
        f"INSERT INTO {LogLine._meta.db_table} ({', '.join(COPY_COLUMNS)}) "
        f"SELECT * FROM (VALUES {', '.join([row] * count)}) AS batch WHERE EXISTS ("
        f"SELECT 1 FROM {attempts} WHERE id = %s AND state IN ({states}) FOR NO KEY UPDATE)"
    )


@statements.query
def started_attempt_locked(pk: int):
    """A started attempt's job, the attempt locked (its writers' fence)."""
    started = Attempt.objects.select_for_update(no_key=True).filter(pk=pk, state__in=STARTED_ATTEMPT_STATES)
    return started.values_list("job_id", flat=True)[:1]


@statements.query
def attempt_locked(pk: int):
    """Any attempt's job, the attempt locked."""
    return Attempt.objects.select_for_update(no_key=True).filter(pk=pk).values_list("job_id", flat=True)[:1]


@statements.query
def last_seq(job_id: int, attempt_id: int):
    """The attempt's last line number: the (job, attempt, seq) index read backwards from its end."""
    return (
        LogLine.objects.filter(job_id=job_id, attempt_id=attempt_id).order_by("-seq").values_list("seq", flat=True)[:1]
    )


def unstored(attempt_id: int, rows: list[NewLine]) -> list[NewLine]:
    """The rows not stored yet. A rank's lines are stored in rank_seq order under the attempt's
    lock, so what is stored of a rank is a prefix: everything up to its highest rank_seq."""
    stored_up_to = {}
    for rank in {row.rank for row in rows}:
        # ORDER BY ... LIMIT 1 walks the (attempt, rank, rank_seq) index backwards on both databases.
        mine = LogLine.objects.filter(attempt_id=attempt_id, rank=rank).order_by("-rank_seq")
        stored_up_to[rank] = mine.values_list("rank_seq", flat=True).first() or 0
    return [row for row in rows if row.rank_seq > stored_up_to[row.rank]]


def insert_rows(rows: list) -> None:
    """Bulk insert: COPY on PostgreSQL for large batches, otherwise one INSERT run for each row
    (executemany: one prepared statement on SQLite, the rows pipelined on PostgreSQL).

    Rows go in as plain tuples: building model instances' SQL per row costs
    more than the insert itself.
    """
    table = LogLine._meta.db_table
    if connection.vendor == "postgresql" and len(rows) >= COPY_MIN_ROWS:
        # The driver's own cursor: its errors are made Django's here, as a query's are, or a
        # connection lost in mid-COPY was not a DatabaseError to the writer (which spools on
        # one) and its storer thread died with the batch.
        with connection.cursor() as cursor, connection.wrap_database_errors:
            with cursor.cursor.copy(f"COPY {table} ({', '.join(COPY_COLUMNS)}) FROM STDIN") as copy:
                for r in rows:
                    copy.write_row(r.columns(r.ts))
        return
    values = insert_values(rows)
    placeholders = ", ".join(["%s"] * len(COPY_COLUMNS))
    with connection.cursor() as cursor:
        cursor.executemany(f"INSERT INTO {table} ({', '.join(COPY_COLUMNS)}) VALUES ({placeholders})", values)
