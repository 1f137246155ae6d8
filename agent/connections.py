"""The agent's threads and the database's connection pool (PostgreSQL, services mode)."""

from django.db import connection


def hand_back() -> None:
    """Before this thread waits (between a running job's polls, between lease renewals,
    between log batches): with a pool its connection goes back to it, and its next query
    takes one again (checked). An agent's threads then share the pool instead of each
    holding a connection while idle: eight busy GPUs held more than the pool's 20 (every
    rank's runner, log storer, lease keeper and MLflow start), threads waited 5 s for one
    and failed, and leases expired. An SQLite connection stays with its thread: there is
    no pool, and opening one again costs ~1 ms."""
    if connection.connection is None or connection.in_atomic_block:
        return
    if getattr(connection, "pool", None) is not None:
        connection.close()
