"""The PostgreSQL pool's check (portal/postgresql): a connection resting in the pool is handed
out without a round trip, one the server ended is found and replaced."""

import time

import psycopg
import pytest
from django.db.utils import ConnectionHandler
from psycopg_pool import ConnectionPool

from portal.postgresql import base
from tests.factories import services_database


@pytest.fixture
def database():
    with services_database() as services:
        yield services["DATABASE_URL"]


@pytest.fixture
def round_trips(monkeypatch):
    """The checks that sent psycopg_pool's empty query."""
    sent = []
    real = ConnectionPool.check_connection

    def counted(conn):
        sent.append(conn)
        return real(conn)

    monkeypatch.setattr(ConnectionPool, "check_connection", staticmethod(counted))
    return sent


def test_an_idle_connection_is_checked_without_a_round_trip(database, round_trips):
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("SELECT 1")
        base.check_connection(conn)
        assert round_trips == []
        conn.execute("BEGIN")  # not idle: the empty query decides
        base.check_connection(conn)
        assert round_trips == [conn]


def test_a_connection_the_server_ended_fails_its_check(database, round_trips):
    with psycopg.connect(database, autocommit=True) as conn, psycopg.connect(database, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
        deadline = time.monotonic() + 5
        while not base.has_something_to_read(conn.fileno()) and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(psycopg.OperationalError):
            base.check_connection(conn)
        assert round_trips == [conn]
        with pytest.raises(ConnectionError):  # broken now: refused without asking the server
            base.check_connection(conn)


def test_djangos_pool_takes_the_check_and_replaces_a_connection_the_server_ended(database, django_db_blocker):
    import dj_database_url

    settings = dj_database_url.parse(database)
    handler = ConnectionHandler(
        {
            "default": {
                **settings,
                "ENGINE": "portal.postgresql",
                "CONN_HEALTH_CHECKS": True,
                "OPTIONS": {"pool": {"min_size": 1, "max_size": 1, "timeout": 5}},
            }
        }
    )
    wrapper = handler["default"]
    with django_db_blocker.unblock():  # a connection of its own, outside the test database
        try:
            assert wrapper.pool._check is base.check_connection
            with wrapper.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                first = cursor.fetchone()[0]
            wrapper.close()  # back to the pool
            with psycopg.connect(database, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", [first])
            time.sleep(0.2)
            with wrapper.cursor() as cursor:  # no error: the pool's check dropped the dead one
                cursor.execute("SELECT pg_backend_pid()")
                assert cursor.fetchone()[0] != first
        finally:
            wrapper.close()
            wrapper.close_pool()
