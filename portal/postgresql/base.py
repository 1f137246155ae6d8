"""Services mode's database: Django's PostgreSQL backend whose pool checks a connection it
hands out without a round trip when it can.

Django's pool health check (`CONN_HEALTH_CHECKS`, psycopg_pool's `check_connection`) sends an
empty query every time a connection is taken from the pool, so that one broken by a database
restart is replaced instead of failing its first statement. Hangar's threads take one often:
an agent's runner, its log storer, its MLflow start and its lease renewals each hand theirs
back before they wait, and every take paid that round trip: about five per short job from
submit to close (bench/attempt_cpu.py: 199 for 40 jobs), 4-5 % of an agent's and of the
scheduler's samples under load (py-spy, bench/throughput.py).

A connection resting in the pool has nothing to read: the server only speaks when asked.
When the server ends it (a restart, a crash, `pg_terminate_backend`) it sends an error and
closes the socket, which becomes readable. So the check looks at the socket first (`poll`,
no round trip) and sends the empty query only when something is waiting there, or when the
connection is not idle; psycopg_pool replaces a connection whose check raises, as before.
A connection that a dead network link cut silently is found by neither check (the empty
query would wait on TCP's timeouts as the first statement does).

It also runs the statements compiled once (portal/statements.py) as prepared statements.
Django sends every statement with its values in its text, so the server parses and plans
each one anew: planning was 29 % and parsing 16 % of PostgreSQL's CPU under short jobs
(perf, bench/attempt_cpu.py). Inside `prepared_statements()` a statement is sent with its
values apart (psycopg's server-side binding) and prepared on its connection the first time;
later runs on that connection skip the parse and, once PostgreSQL settles on a generic plan,
the planning too (bench/attempt_cpu.py, interleaved runs: the database's CPU per `echo`
attempt 9.6-10.4 -> 5.7-6.8 ms). Every other statement is sent as before. A pooler in transaction mode that cannot keep
prepared statements (PgBouncer before 1.21) needs HANGAR_DB_PREPARED=0.
"""

import contextlib
import select
import sys

import psycopg
from django.db.backends.postgresql.base import CursorMixin
from django.db.backends.postgresql.base import DatabaseWrapper as PostgreSQLDatabaseWrapper
from psycopg import pq
from psycopg_pool import ConnectionPool


def check_connection(conn) -> None:
    """psycopg_pool's `check`: raise when `conn` should not be handed out (the pool drops it)."""
    if conn.closed or conn.broken:
        raise ConnectionError("the connection is closed")
    if conn.info.transaction_status == pq.TransactionStatus.IDLE and not has_something_to_read(conn.fileno()):
        return
    ConnectionPool.check_connection(conn)  # the empty query: it reads what waits, and raises when the server left


def has_something_to_read(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


class PreparedCursor(CursorMixin, psycopg.Cursor):
    """Values sent apart from the statement, which is prepared on its connection (once: psycopg
    keeps the names of those it prepared, up to its `prepared_max`, and runs them by name)."""

    def execute(self, query, params=None, *, prepare=None, binary=None):
        return super().execute(query, params, prepare=True, binary=binary)


# psycopg prepares nothing while a connection's threshold is None (Django's default, even
# when a statement asks) and everything run that many times otherwise: this one is never
# reached, so only what asks is prepared.
ONLY_WHEN_ASKED = sys.maxsize


class DatabaseWrapper(PostgreSQLDatabaseWrapper):
    preparing = False  # this thread's wrapper (Django keeps one per thread)

    @contextlib.contextmanager
    def prepared_statements(self):
        """The statements run inside are prepared on their connection (see the module); none
        are when the database's PREPARED_STATEMENTS setting is off (HANGAR_DB_PREPARED=0)."""
        if not self.settings_dict.get("PREPARED_STATEMENTS", True):
            yield
            return
        before, self.preparing = self.preparing, True
        try:
            yield
        finally:
            self.preparing = before

    def create_cursor(self, name=None):
        if not self.preparing or name is not None:
            return super().create_cursor(name)
        connection = self.connection
        if connection.prepare_threshold is None:
            connection.prepare_threshold = ONLY_WHEN_ASKED
        # Django's own cursor set-up (its time zone), with this kind of cursor.
        usual, connection.cursor_factory = connection.cursor_factory, PreparedCursor
        try:
            return super().create_cursor(name)
        finally:
            connection.cursor_factory = usual

    @property
    def pool(self):
        pool = super().pool
        # Django passes psycopg_pool's own check when CONN_HEALTH_CHECKS is on and refuses a
        # `check` among the pool's options: ours replaces it once, when the pool is made.
        if pool is not None and pool._check is ConnectionPool.check_connection:
            pool._check = check_connection
        return pool
