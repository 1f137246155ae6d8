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
"""

import select

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


class DatabaseWrapper(PostgreSQLDatabaseWrapper):
    @property
    def pool(self):
        pool = super().pool
        # Django passes psycopg_pool's own check when CONN_HEALTH_CHECKS is on and refuses a
        # `check` among the pool's options: ours replaces it once, when the pool is made.
        if pool is not None and pool._check is ConnectionPool.check_connection:
            pool._check = check_connection
        return pool
