"""agent/connections.py: a waiting thread hands its connection back to the pool, never an SQLite one."""

import pytest
from django.db import connection, transaction

from agent import connections
from jobs.models import Job


class Pool:
    """Stands for psycopg_pool's pool: where Django's close() puts a pooled connection back."""


@pytest.mark.django_db(transaction=True)
def test_an_sqlite_connection_stays_with_its_thread():
    Job.objects.exists()
    opened = connection.connection
    connections.hand_back()
    assert connection.connection is opened  # no pool: reopening would cost ~1 ms per wait


@pytest.mark.django_db(transaction=True)
def test_with_a_pool_the_connection_goes_back_but_never_inside_a_transaction(monkeypatch):
    monkeypatch.setattr(type(connection), "pool", Pool(), raising=False)
    with transaction.atomic():
        Job.objects.exists()
        connections.hand_back()
        assert connection.connection is not None  # its transaction's connection is kept
    connections.hand_back()
    assert connection.connection is None  # closed: Django returns a pooled one to its pool
    assert not Job.objects.exists()  # the next query takes one again
