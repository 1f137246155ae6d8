"""The embedded database: Django's SQLite backend whose writers queue on a lock file.

Web, scheduler, notifier and every agent write one SQLite file, and SQLite lets one writer in
at a time. A writer that finds the write lock taken waits in SQLite's busy handler: it sleeps
and tries again, in steps that grow to 100 ms. Under many writers, one that lost a few times
sleeps 100 ms between tries while the others take the lock the moment it is free: seconds of
tail (bench/throughput.py, 4 agents of 8 GPUs: preflight p99 3.2 s, the hand-off p99 3.6 s).

Here a write first takes an exclusive `flock` on `<database>.lock` beside the file, and holds
it until its transaction ends: a transaction from its BEGIN to its COMMIT or ROLLBACK, a write
outside one (autocommit) for that statement. The kernel wakes a waiter as soon as the lock is
let go, so writers take turns with no sleeping between tries. Readers take nothing (WAL).

As with SQLite's own lock, a transaction must never wait for another thread's write: here that
wait would not end after the busy timeout, it would not end.

A closed connection is kept for the process's next one (`Parked`): Django's connections are
per thread, and most threads here are short (a web request, an attempt's runner, its log
storer, its MLflow start), each opening the file anew.
"""

import fcntl
import functools
import os
import sqlite3
import threading
from contextlib import contextmanager

from django.db.backends.sqlite3.base import FORMAT_QMARK_REGEX, SQLiteCursorWrapper
from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteDatabaseWrapper

WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER")


class WriteQueue:
    """One connection's place in the queue of writers: a file descriptor of its own on the lock
    file (flock locks belong to an open file, so the threads of one process queue too)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.holder: int | None = None  # the pid that holds it: a forked child must not let it go

    def acquire(self) -> bool:
        """Wait for the turn to write; False when this connection holds it already."""
        if self.holder is not None:
            return False
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.holder = os.getpid()
        return True

    def release(self) -> None:
        if self.holder == os.getpid():
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.holder = None

    def close(self) -> None:
        self.release()
        os.close(self.fd)

    @contextmanager
    def turn(self):
        taken = self.acquire()
        try:
            yield
        finally:
            if taken:
                self.release()


class QueuedConnection(sqlite3.Connection):
    """sqlite3's connection, with its place in the writers' queue (None for a memory database)."""

    queue: WriteQueue | None = None
    parked_as: tuple[tuple, str] | None = None  # its key among kept connections, and its file


def writes(query: str) -> bool:
    return query.lstrip()[:7].upper().startswith(WRITES)


# Queries up to this long have their placeholders rewritten once per process, not per run.
CONVERTED_QUERY_CHARS = 8192


@functools.lru_cache(maxsize=512)
def qmark_style(query: str) -> str:
    """Django's "format" placeholders (%s) as SQLite's qmark ones (?), as Django's wrapper
    rewrites them. A regular expression over the whole text on every run: ~80 us for the
    agent's load of its attempt (121 columns), a statement whose text is the same each time
    (portal/statements.py), and a string keeps its hash, so finding it again costs little."""
    return FORMAT_QMARK_REGEX.sub("?", query).replace("%%", "%")


class QueuedCursorWrapper(SQLiteCursorWrapper):
    """A write outside a transaction (autocommit) waits its turn for that statement."""

    def convert_query(self, query, *, param_names=None):
        if param_names is None and len(query) <= CONVERTED_QUERY_CHARS:
            return qmark_style(query)
        return super().convert_query(query, param_names=param_names)

    def execute(self, query, params=None):
        with self.turn(query):
            return super().execute(query, params)

    def executemany(self, query, param_list):
        with self.turn(query):
            return super().executemany(query, param_list)

    @contextmanager
    def turn(self, query: str):
        queue = self.connection.queue
        if queue is None or self.connection.in_transaction or not writes(query):
            yield  # a read, or inside a transaction: its BEGIN waited its turn
            return
        with queue.turn():
            yield


PARKED_PER_DATABASE = 16


def file_identity(path: str) -> tuple[int, int] | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


class Parked:
    """Idle connections of this process, kept for its next thread that needs one. A new
    connection reads the whole schema on its first statement (~1 ms of CPU, more than most
    queries): an agent opened three for each attempt, the web one for each request.

    A connection is parked only in autocommit, outside any transaction and not holding its turn
    to write, so it is as a new one would be; it is taken again only in the process that parked
    it (no SQLite connection may cross a fork), and only while its file is the same file (one
    deleted and made anew under its name, as a test database is, is not)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.idle: dict[tuple, list[tuple[QueuedConnection, tuple[int, int] | None]]] = {}
        self.forked: list = []  # a parent's connections, never used nor closed here

    @staticmethod
    def key(conn_params: dict) -> tuple:
        return tuple(sorted((name, repr(value)) for name, value in conn_params.items()))

    def take(self, key: tuple, path: str) -> QueuedConnection | None:
        stale = []
        with self.lock:
            self.after_fork()
            idle = self.idle.get(key, [])
            identity = file_identity(path) if idle else None
            found = None
            while idle and found is None:
                conn, parked_on = idle.pop()
                if parked_on is not None and parked_on == identity:
                    found = conn
                else:
                    stale.append(conn)
        for conn in stale:
            close_connection(conn)
        return found

    def park(self, conn: QueuedConnection) -> bool:
        key, path = conn.parked_as
        with self.lock:
            self.after_fork()
            idle = self.idle.setdefault(key, [])
            if len(idle) >= PARKED_PER_DATABASE:
                return False
            idle.append((conn, file_identity(path)))
        return True

    def after_fork(self) -> None:
        if self.pid != os.getpid():
            self.forked.append(self.idle)
            self.idle, self.pid = {}, os.getpid()


def close_connection(conn: QueuedConnection) -> None:
    try:
        conn.close()
    finally:
        if conn.queue is not None:
            conn.queue.close()


PARKED = Parked()


class DatabaseWrapper(SQLiteDatabaseWrapper):
    def get_connection_params(self):
        return {**super().get_connection_params(), "factory": QueuedConnection}

    def get_new_connection(self, conn_params):
        if self.is_in_memory_db():
            return super().get_new_connection(conn_params)
        key, path = Parked.key(conn_params), str(conn_params["database"])
        if (parked := PARKED.take(key, path)) is not None:
            return parked
        conn = super().get_new_connection(conn_params)
        conn.queue = WriteQueue(f"{self.settings_dict['NAME']}.lock")
        conn.parked_as = (key, path)
        return conn

    def parkable(self) -> bool:
        conn = self.connection
        return (
            conn is not None
            and getattr(conn, "parked_as", None) is not None  # a file database's
            and self.autocommit
            and not self.in_atomic_block
            and not conn.in_transaction
            and conn.queue.holder is None
        )

    def create_cursor(self, name=None):
        return self.connection.cursor(factory=QueuedCursorWrapper)

    def _start_transaction_under_autocommit(self):
        # BEGIN IMMEDIATE takes SQLite's write lock: it waits its turn first, and holds it to the end.
        queue = self.connection.queue
        taken = queue is not None and queue.acquire()
        try:
            super()._start_transaction_under_autocommit()
        except BaseException:
            if taken:
                queue.release()
            raise

    def _commit(self):
        try:
            return super()._commit()
        finally:
            self._end_turn()

    def _rollback(self):
        try:
            return super()._rollback()
        finally:
            self._end_turn()

    def _close(self):
        if self.parkable() and PARKED.park(self.connection):
            return None
        queue = getattr(self.connection, "queue", None)
        try:
            return super()._close()
        finally:
            if queue is not None:
                queue.close()

    def _end_turn(self) -> None:
        queue = getattr(self.connection, "queue", None)
        if queue is not None and not self.connection.in_transaction:
            queue.release()
