"""The embedded database's writers take turns on a lock file (portal/sqlite/base.py): a write
waits for the transaction that holds the turn and goes in as soon as it ends, with no busy loop."""

import fcntl
import os
import stat
import time

import pytest
from django.db import connection, transaction

from portal.models import Project
from portal.sqlite.base import WriteQueue, writes
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
