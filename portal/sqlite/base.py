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
"""

import fcntl
import os
import sqlite3
from contextlib import contextmanager

from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteDatabaseWrapper
from django.db.backends.sqlite3.base import SQLiteCursorWrapper

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


def writes(query: str) -> bool:
    return query.lstrip()[:7].upper().startswith(WRITES)


class QueuedCursorWrapper(SQLiteCursorWrapper):
    """A write outside a transaction (autocommit) waits its turn for that statement."""

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


class DatabaseWrapper(SQLiteDatabaseWrapper):
    def get_connection_params(self):
        return {**super().get_connection_params(), "factory": QueuedConnection}

    def get_new_connection(self, conn_params):
        conn = super().get_new_connection(conn_params)
        if not self.is_in_memory_db():
            conn.queue = WriteQueue(f"{self.settings_dict['NAME']}.lock")
        return conn

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
