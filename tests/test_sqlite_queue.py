"""The embedded database's writers take turns on a lock file (portal/sqlite/base.py): a write
waits for the transaction that holds the turn and goes in as soon as it ends, with no busy loop."""

import fcntl
import os
import sqlite3
import stat
import time

import pytest
from django.db import connection, transaction

from portal.models import Project
from portal.sqlite.base import Parked, QueuedConnection, WriteQueue, writes
from tests.factories import in_thread

pytestmark = pytest.mark.skipif(connection.vendor != "sqlite", reason="the embedded database's own")


def test_it_tells_writes_from_reads():
    assert all(writes(q) for q in ["INSERT INTO t", "  update t set", "DELETE FROM t", "CREATE TABLE t (v)"])
    assert not any(writes(q) for q in ["SELECT 1", "BEGIN IMMEDIATE", "PRAGMA foreign_keys = ON", "SAVEPOINT s1"])


def write_then_time() -> float:
    Project.objects.filter(slug="queued").update(name="second")  # autocommit: one statement
    return time.monotonic()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("ending", ["commit", "rollback"])
def test_a_write_waits_for_the_transaction_that_holds_the_turn_and_goes_in_when_it_ends(ending):
    Project.objects.create(slug="queued", name="first")
    done: list[float] = []
    try:
        with transaction.atomic():
            Project.objects.filter(slug="queued").update(name="held")
            thread = in_thread(write_then_time, done)
            time.sleep(0.5)
            assert not done  # waiting its turn (SQLite's busy handler would wait too, polling)
            ended = time.monotonic()
            if ending == "rollback":
                raise RuntimeError("rolled back")
    except RuntimeError:
        pass
    thread.join(10)
    assert done and done[0] >= ended
    assert Project.objects.get(slug="queued").name == "second"


def test_a_forked_child_does_not_let_its_parents_turn_go(tmp_path):
    path = str(tmp_path / "db.lock")
    queue = WriteQueue(path)
    assert queue.acquire() and not queue.acquire()  # held: a second acquire is a no-op
    pid = os.fork()
    if pid == 0:  # the child shares the open file: letting it go here would let the parent's go
        queue.close()
        os._exit(0)
    os.waitpid(pid, 0)
    other = WriteQueue(path)
    with pytest.raises(BlockingIOError):
        fcntl.flock(other.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    queue.release()
    fcntl.flock(other.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free now
    other.close()
    queue.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # Hangar's alone, like the database file


def raw_connection_of_a_query():
    Project.objects.filter(slug="any").exists()
    return connection.connection


@pytest.mark.django_db(transaction=True)
def test_a_threads_closed_connection_is_the_next_threads_and_still_works():
    """Opening one reads the whole schema again (~1 ms): a short thread (a web request, an
    attempt's log storer) takes the one the last thread closed, as it was."""
    first, second = [], []
    in_thread(raw_connection_of_a_query, first).join(10)
    in_thread(lambda: (raw_connection_of_a_query(), Project.objects.create(slug="p", name="p")), second).join(10)

    assert second[0][0] is first[0]
    assert Project.objects.filter(slug="p").exists()  # its write went in, and its turn was let go
    other = WriteQueue(f"{connection.settings_dict['NAME']}.lock")
    fcntl.flock(other.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other.close()


@pytest.mark.django_db(transaction=True)
def test_a_connection_closed_inside_a_transaction_is_not_kept():
    def closed_in_a_transaction():
        with transaction.atomic():
            Project.objects.create(slug="t", name="t")
            raw = connection.connection
            connection.close()
        return raw

    first, later = [], []
    in_thread(closed_in_a_transaction, first).join(10)
    in_thread(raw_connection_of_a_query, later).join(10)

    assert later[0] is not first[0]
    assert not Project.objects.filter(slug="t").exists()  # rolled back with it


def test_a_kept_connection_is_not_taken_for_a_file_made_anew_nor_in_a_forked_child(tmp_path):
    path = str(tmp_path / "db.sqlite3")
    key = Parked.key({"database": path, "factory": QueuedConnection})
    parked = Parked()

    def opened():
        conn = sqlite3.connect(path, factory=QueuedConnection)
        conn.queue, conn.parked_as = WriteQueue(f"{path}.lock"), (key, path)
        conn.execute("CREATE TABLE IF NOT EXISTS t (v)")
        return conn

    same = opened()
    assert parked.park(same) and parked.take(key, path) is same
    assert parked.take(key, path) is None  # taken: no longer kept

    gone = opened()
    parked.park(gone)
    os.remove(path)
    opened().close()  # a new file under the same name
    assert parked.take(key, path) is None
    with pytest.raises(sqlite3.ProgrammingError):
        gone.execute("SELECT 1")  # closed, not left open

    kept = opened()
    parked.park(kept)
    pid = os.fork()
    if pid == 0:  # no SQLite connection may cross a fork
        os._exit(0 if parked.take(key, path) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parked.take(key, path) is kept  # the parent's is still the parent's
