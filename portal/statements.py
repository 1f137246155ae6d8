"""Statements compiled once: the hot queries of a job's life, built and compiled into SQL
the first time they run in a process, then run again with other values.

Django builds a QuerySet's query and compiles its SQL on every run. For the short
statements an agent sends per attempt that is most of their CPU: loading the attempt to
run with its job, project, environment and user (121 columns) takes ~1.8 ms to build
and compile and ~0.2 ms to execute on SQLite. A statement here is a function of named,
typed values that builds the QuerySet (or the update) with the ORM:

    @statements.query
    def attempt_to_run(pk: int):
        return Attempt.objects.select_related("job").filter(pk=pk)[:1]

    attempt = attempt_to_run.first(pk=7)

The first run in a process compiles it twice, with two sets of stand-in values, and keeps
the SQL and where each value goes in its parameters; every later run copies the kept
compiler with the values put in their places, and Django's own iterables make the rows
(model instances, select_related included, dicts or tuples) as the QuerySet would. On
PostgreSQL the statement is also prepared on each connection it runs on (the server
parses and plans it once there: portal/postgresql).

What a statement may take, so that this stays exact:
- values of the types in KINDS, each adapted as Django adapts that type for its field;
  a list of ids (`list[int]`) only through the `__any` lookup (`AnyOf`, below): one SQL
  text for any number of them, where `__in` writes one placeholder for each;
- SQL that does not depend on the values: no None in a condition (that is IS NULL; an
  update's new value may be None where its type says `| None`), no list for __in
  (its length is in the SQL), no value an expression transforms (__contains adds %...%).
  The first compile checks this and raises StatementError otherwise: the two compiles
  must give one SQL text, and each parameter that differs between them must be the
  stand-in of exactly one value, adapted. Anything else is a constant, a JSON one
  included (a value the statement's build writes as it is: one statement per such value,
  as `attempt_ended` keeps one per set of states).
"""

import contextlib
import inspect
import json
import threading
import types
import typing
import weakref
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db import DEFAULT_DB_ALIAS, NotSupportedError, connections, transaction
from django.db.models import IntegerField, Lookup, QuerySet
from django.db.models.sql import UpdateQuery
from django.db.models.sql.constants import ROW_COUNT
from django.db.transaction import TransactionManagementError
from psycopg.types.json import Json, Jsonb

JSON_WRAPPER = (Json, Jsonb)  # how PostgreSQL's backend passes a JSON value (SQLite's: a string)


class StatementError(Exception):
    """A statement's SQL depends on its values, or a value is put in it in a way it cannot follow."""


def _int(index: int, round_: int) -> int:
    # Positive and inside a 32-bit integer: Django refuses (as an empty result) a value out of a field's range.
    return 1_900_000_000 + round_ * 100_000 + index


def _str(index: int, round_: int) -> str:
    return f"\x1fstatement value {round_}.{index}\x1f"


def _float(index: int, round_: int) -> float:
    return 1.9e9 + round_ * 1e5 + index + 0.25


def _datetime(index: int, round_: int) -> datetime:
    return datetime(2990 + round_, 1, 1, tzinfo=UTC) + timedelta(microseconds=index + 1)


def _decimal(index: int, round_: int) -> Decimal:
    return Decimal(f"1900{round_}{index:04d}.0625")


def _date(index: int, round_: int) -> date:
    return date(2990 + round_, 1, 1) + timedelta(days=index)


def _as_is(value, connection):
    return value


def _adapt_datetime(value, connection):
    return connection.ops.adapt_datetimefield_value(value)


def _adapt_date(value, connection):
    return connection.ops.adapt_datefield_value(value)


def _ids(index: int, round_: int) -> list[int]:
    return [_int(index, round_)]


def _adapt_ids(value, connection):
    return AnyOf.param(value, connection)


@IntegerField.register_lookup
class AnyOf(Lookup):
    """`field__any=[1, 2, 3]`: the field is one of these integers, in one SQL text for any
    number of them, so a statement can take the list (`list[int]`): PostgreSQL compares with
    the array (`= ANY(%s::bigint[])` for a bigint column), SQLite reads the list as JSON
    (`json_each`). An empty list matches nothing.

    The array is cast to the column's type: psycopg sends a list of small ids as `smallint[]`,
    and `bigint = smallint` has no hash function of one type for both sides, so where the
    planner filters rows by the list (no statistics yet: a fresh queue) it searched the whole
    array for each row — 29 ms for a pass's 500-job chunk against 10,000 queued jobs, 1.8 ms cast."""

    lookup_name = "any"
    prepare_rhs = False

    @staticmethod
    def param(values, connection):
        ids = [int(v) for v in values]
        return ids if connection.vendor == "postgresql" else json.dumps(ids)

    def as_sql(self, compiler, connection):
        lhs, params = self.process_lhs(compiler, connection)
        if connection.vendor == "postgresql":
            sql = f"{lhs} = ANY(%s::{self.lhs.output_field.cast_db_type(connection)}[])"  # see above
        elif connection.vendor == "sqlite":
            sql = f"{lhs} IN (SELECT value FROM json_each(%s))"
        else:
            raise NotSupportedError(f"__any is written for PostgreSQL and SQLite, not {connection.vendor}")
        return sql, [*params, self.param(self.rhs, connection)]


# A value's type -> (its stand-ins, how Django adapts it for the database). The fields
# of these types (IntegerField and its kin, CharField, TextField, FloatField,
# DecimalField, DateTimeField, DateField) adapt a value of that type this way, in a
# filter as in an update (the first compile checks it, for each statement).
KINDS: dict[type, tuple[typing.Callable[[int, int], object], typing.Callable]] = {
    int: (_int, _as_is),
    str: (_str, _as_is),
    float: (_float, _as_is),
    Decimal: (_decimal, _as_is),
    datetime: (_datetime, _adapt_datetime),
    date: (_date, _adapt_date),
    list[int]: (_ids, _adapt_ids),  # only in an __any lookup (its one parameter)
}
# Not taken for these types although instances of them: True for 1, a datetime for a day.
REFUSED = {int: bool, date: datetime}


@dataclass(frozen=True)
class Compiled:
    """One statement's SQL on one database, and the compiler that made it (set up: its
    selected columns, related models and converters), copied for each run."""

    sql: str
    params: tuple
    # (position in params, index of the value, the type the database's adapter gives it or None)
    slots: tuple[tuple[int, int, type | None], ...]
    compiler: object
    queryset: QuerySet | None  # a query's QuerySet, None for an update
    locks: bool  # SELECT ... FOR UPDATE: only inside a transaction
    # A query's converters per connection (a thread's own): Django asks each selected column
    # for them on every run, a quarter of the CPU of the agent's 121-column attempt load.
    # They are bound to the connection they were asked on, so they are kept per connection.
    converters: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


class _Prepared:
    """The kept query as a run's QuerySet sees it: everything read from the query, but
    the compiler is the run's copy, whose SQL is made already."""

    def __init__(self, query, compiler):
        self._query = query
        self._compiler = compiler

    def get_compiler(self, using=None, connection=None, elide_empty=True):
        return self._compiler

    def __getattr__(self, name):
        return getattr(self._query, name)


class Statement:
    """A query or an update built by `build` from its named, typed values (see the module)."""

    def __init__(self, build: typing.Callable, update: bool = False):
        self.build = build
        self.update_statement = update
        self.names = list(inspect.signature(build).parameters)
        hints = typing.get_type_hints(build)
        self.kinds, self.optional = [], set()
        for index, name in enumerate(self.names):
            kind = hints.get(name)
            if update and typing.get_origin(kind) in (typing.Union, types.UnionType):
                kinds = [k for k in typing.get_args(kind) if k is not type(None)]
                if len(kinds) == 1 and len(typing.get_args(kind)) == 2:
                    kind = kinds[0]
                    self.optional.add(index)
            if kind not in KINDS:
                known = ", ".join(_kind_name(k) for k in KINDS)
                optional = " (or, a new value of an update, one of them | None)" if update else ""
                raise StatementError(f"{build.__qualname__}: give {name} one of the types {known}{optional}")
            self.kinds.append(kind)
        self.compiled: dict[str, Compiled] = {}
        self.lock = threading.Lock()
        self.__doc__ = build.__doc__
        self.__name__ = build.__name__

    def __repr__(self) -> str:
        return f"<statement {self.build.__module__}.{self.build.__qualname__}>"

    # --- compiling, once per database ----------------------------------------------------------

    def _built(self, round_: int):
        values = [KINDS[kind][0](index, round_) for index, kind in enumerate(self.kinds)]
        built = self.build(*values)
        if self.update_statement:
            queryset, changes = built
            query = queryset.query.chain(UpdateQuery)
            query.add_update_values(changes)
            query.clear_select_clause()
            return values, queryset, query
        return values, built, built.query

    def _compile(self, alias: str) -> Compiled:
        connection = connections[alias]
        rounds = []
        for round_ in (0, 1):
            values, queryset, query = self._built(round_)
            compiler = query.get_compiler(using=alias)
            sql, params = compiler.as_sql()
            rounds.append((values, queryset, query, compiler, sql, tuple(params)))
        (values, queryset, query, compiler, sql, params), (others, _, _, _, sql_b, params_b) = rounds
        where = self.build.__qualname__
        if self.update_statement and query.related_updates:
            raise StatementError(f"{where}: an update of more than one table")
        if sql != sql_b or len(params) != len(params_b):
            raise StatementError(f"{where}: its SQL depends on its values")
        adapted = [
            (KINDS[kind][1](a, connection), KINDS[kind][1](b, connection))
            for kind, a, b in zip(self.kinds, values, others, strict=True)
        ]
        slots, used = [], set()
        for position, (a, b) in enumerate(zip(params, params_b, strict=True)):
            if _same_constant(a, b):
                continue  # a constant of the statement
            mine = [
                (index, wrap)
                for index, (x, y) in enumerate(adapted)
                if (wrap := _wrapper(a, x)) is not False and _wrapper(b, y) == wrap
            ]
            if len(mine) != 1:
                raise StatementError(f"{where}: parameter {position} ({a!r}) is none of its values as given")
            slots.append((position, *mine[0]))
            used.add(mine[0][0])
        if self.optional:
            # None is put in as NULL only where the value is a column's new value (SET col = NULL);
            # in a condition, col = NULL is never true (Django writes IS NULL there).
            where_params = compiler.compile(compiler.query.where)[1] if compiler.query.where else []
            new_values = len(params) - len(where_params)
            if misplaced := sorted(
                {self.names[i] for position, i, _ in slots if i in self.optional and position >= new_values}
            ):
                raise StatementError(
                    f"{where}: {', '.join(misplaced)} may be None, so only a new value, not a condition"
                )
        if unused := [self.names[index] for index in range(len(self.names)) if index not in used]:
            raise StatementError(f"{where}: {', '.join(unused)} not found in its SQL as given (transformed?)")
        kept = None if self.update_statement else queryset
        locks = bool(getattr(query, "select_for_update", False))
        return Compiled(sql, params, tuple(slots), compiler, kept, locks)

    def _prepared(self, values: dict, using: str):
        compiled = self.compiled.get(using)
        if compiled is None:
            with self.lock:
                compiled = self.compiled.get(using) or self._compile(using)
                self.compiled[using] = compiled
        if set(values) != set(self.names):
            raise TypeError(f"{self!r} takes {', '.join(self.names)}; given {', '.join(sorted(values))}")
        connection = connections[using]
        params = list(compiled.params)
        for position, index, wrap in compiled.slots:
            value = values[self.names[index]]
            if value is None and index in self.optional:
                params[position] = None
                continue
            kind = self.kinds[index]
            if not _of_kind(value, kind):
                raise TypeError(f"{self!r}: {self.names[index]} must be {_kind_name(kind)}, not {value!r}")
            value = KINDS[kind][1](value, connection)
            params[position] = value if wrap is None else wrap(value)
        if compiled.locks and connection.features.has_select_for_update and connection.get_autocommit():
            raise TransactionManagementError("select_for_update cannot be used outside of a transaction.")
        compiler = _copy(compiled.compiler)
        compiler.connection = connection
        compiler.using = using
        sql = compiled.sql
        compiler.as_sql = lambda *args, **kwargs: (sql, params)
        if compiled.queryset is not None:
            converters = compiled.converters.get(connection)
            if converters is None:
                fields = [column[0] for column in compiler.select[: compiler.col_count]]
                converters = compiled.converters.setdefault(connection, compiler.get_converters(fields))
            compiler.get_converters = lambda expressions: converters  # the run's fields are the kept ones
        return compiled, compiler

    # --- running ------------------------------------------------------------------------------

    def rows(self, using: str = DEFAULT_DB_ALIAS, **values) -> list:
        """What the query's QuerySet would give for these values, as a list."""
        if self.update_statement:
            raise TypeError(f"{self!r} is an update: call .update()")
        compiled, compiler = self._prepared(values, using)
        queryset = _copy(compiled.queryset)  # not copy.copy: a QuerySet's __getstate__ runs it
        queryset._query = _Prepared(compiled.queryset.query, compiler)
        queryset._db = using
        queryset._result_cache = None
        with _prepared_on(compiler.connection):
            return list(queryset)

    def first(self, using: str = DEFAULT_DB_ALIAS, **values):
        """The first row, or None (slice the QuerySet, [:1], so only one is read)."""
        return next(iter(self.rows(using, **values)), None)

    def update(self, using: str = DEFAULT_DB_ALIAS, **values) -> int:
        """Run the update; the number of rows it matched."""
        if not self.update_statement:
            raise TypeError(f"{self!r} is a query: call .rows() or .first()")
        _, compiler = self._prepared(values, using)
        with transaction.mark_for_rollback_on_error(using=using), _prepared_on(compiler.connection):
            return compiler.execute_sql(ROW_COUNT)


PREPARED_INSERT_VALUES = 100


def insert(model, columns: tuple[str, ...], rows: list[tuple], using: str = DEFAULT_DB_ALIAS) -> None:
    """Insert rows of plain values, one tuple per row in the order of `columns` (field names),
    as a multi-row INSERT: what `bulk_create` writes, without the model instance per row that
    it builds and saves (a preflight's six checks: ~0.7 ms of CPU that way, ~0.35 ms this one,
    its commit included).
    Each value is prepared by its field, as `bulk_create` prepares it; no default is applied
    (every column is given) and no primary key comes back."""
    opts = model._meta
    fields = [opts.get_field(name) for name in columns]
    connection = connections[using]
    quote = connection.ops.quote_name
    into = f"INSERT INTO {quote(opts.db_table)} ({', '.join(quote(f.column) for f in fields)}) VALUES "
    one = "(" + ", ".join(["%s"] * len(fields)) + ")"
    size = max(1, connection.ops.bulk_batch_size(fields, rows))
    # More rows than one statement takes: all of them or none, as bulk_create.
    whole = transaction.atomic(using=using, savepoint=False) if len(rows) > size else contextlib.nullcontext()
    # Prepared where the backend can (its SQL is the same for as many rows): a few rows only,
    # the kind that come back (a job's event, its preflight's checks), not a one-off batch.
    prepared = (
        _prepared_on(connection) if len(rows) * len(fields) <= PREPARED_INSERT_VALUES else contextlib.nullcontext()
    )
    with whole, transaction.mark_for_rollback_on_error(using=using), prepared, connection.cursor() as cursor:
        for start in range(0, len(rows), size):
            batch = rows[start : start + size]
            params = [
                f.get_db_prep_save(value, connection) for row in batch for f, value in zip(fields, row, strict=True)
            ]
            cursor.execute(into + ", ".join([one] * len(batch)), params)


def _prepared_on(connection):
    """Where the backend can (PostgreSQL's, portal/postgresql), the statement is prepared on
    its connection: its SQL never changes, so the server parses and plans it once."""
    prepared = getattr(connection, "prepared_statements", None)
    return prepared() if prepared is not None else contextlib.nullcontext()


def _copy(kept):
    """A shallow copy of a kept object, for one run."""
    copied = object.__new__(type(kept))
    copied.__dict__.update(kept.__dict__)
    return copied


def _of_kind(value, kind) -> bool:
    if kind == list[int]:  # a list (or tuple) of integers, none of them a bool
        return isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, kind) and not isinstance(value, REFUSED.get(kind, ()))


def _kind_name(kind) -> str:
    return str(kind) if typing.get_origin(kind) else kind.__name__


def _same_constant(a, b) -> bool:
    """Whether two compiles put one constant here. A JSON constant comes wrapped by the
    database's adapter (psycopg's Jsonb on PostgreSQL), which compares by identity: it is
    one constant when both wrap equal values to be written by one function."""
    if type(a) is not type(b):
        return False
    if isinstance(a, JSON_WRAPPER):
        return a.obj == b.obj and a.dumps == b.dumps
    return a == b


def _wrapper(param, adapted) -> type | None | bool:
    """How a parameter is made from a value as adapted: None when it is that value; its type
    when the database's adapter typed it (PostgreSQL's backend sends an integer field's
    value as psycopg's Int4 or Int8, an int); False when it is not made from that value."""
    if type(param) is type(adapted):
        return None if param == adapted else False
    if isinstance(param, type(adapted)):  # a subclass, made from the value
        try:
            return type(param) if type(param)(adapted) == param else False
        except (TypeError, ValueError):
            return False
    return False


def query(build: typing.Callable) -> Statement:
    """A statement that reads: `build(**values)` returns the QuerySet."""
    return Statement(build)


def update(build: typing.Callable) -> Statement:
    """A statement that writes: `build(**values)` returns (QuerySet, {field: new value})."""
    return Statement(build, update=True)
