"""Log ingest: parsing tracebacks and faults, numbering with several writers, bulk
storage, the fence, and the disk spool while the database is unreachable."""

import os
import queue
import textwrap
import threading
import time

import pytest
from django.db import OperationalError
from django.utils import timezone

from agent import output as logingest
from agent.output import LogWriter
from jobs.logparse import TRUNCATION_MARKER, SeverityReader, is_fault
from jobs.models import Attempt, LogLine, Severity, Stream
from tests.factories import make_attempt, make_job, make_node

TRACEBACK = [
    ("step 3", Severity.INFO),
    ("Traceback (most recent call last):", Severity.ERROR),
    ('  File "train.py", line 3, in <module>', Severity.ERROR),
    ("    main()", Severity.ERROR),
    ("KeyError: 'lr'", Severity.ERROR),
    ("", Severity.ERROR),
    ("During handling of the above exception, another exception occurred:", Severity.ERROR),
    ("", Severity.ERROR),
    ("Traceback (most recent call last):", Severity.ERROR),
    ('  File "train.py", line 5, in <module>', Severity.ERROR),
    ("RuntimeError: boom", Severity.ERROR),
    ("cleanup done", Severity.INFO),
]


def test_a_traceback_is_one_error_block_up_to_its_exception_line():
    read = SeverityReader(Stream.STDOUT)

    assert [(text, read(text)) for text, _ in TRACEBACK] == TRACEBACK


def test_a_traceback_on_stderr_ends_in_a_warning_afterwards():
    read = SeverityReader(Stream.STDERR)

    assert [read(t) for t in ("Traceback (most recent call last):", "  x", "ValueError: v", "later")] == [
        Severity.ERROR,
        Severity.ERROR,
        Severity.ERROR,
        Severity.WARNING,
    ]


@pytest.mark.parametrize(
    "text",
    [
        "node1:1:2 [0] NCCL WARN Call to connect returned Connection refused",
        "NCCL error in: ProcessGroupNCCL.cpp:1269, unhandled system error",
        "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "uncorrectable ECC error encountered",
    ],
)
def test_it_recognises_gpu_and_nccl_faults(text):
    assert is_fault(text)


@pytest.mark.parametrize("text", ["epoch 1 loss 0.3", "NCCL INFO Bootstrap : Using eth0", "Xidian dataset loaded"])
def test_ordinary_lines_are_not_faults(text):
    assert not is_fault(text)


# --- writers against the database ---------------------------------------------------


@pytest.fixture
def attempt(project, owner, settings, tmp_path):
    settings.HANGAR_LOG_SPOOL_DIR = tmp_path / "spool"
    node = make_node()
    job = make_job(project, owner)
    return make_attempt(job, node, "running", running_at=timezone.now())


def write(attempt: Attempt, lines: list[bytes], stream: int = Stream.STDOUT, rank: int = 0, node_id=None):
    q: queue.Queue = queue.Queue()
    writer = LogWriter(attempt, q, rank=rank, node_id=node_id)
    writer.start()
    for raw in lines:
        q.put((stream, timezone.now(), raw, False))
    writer.close()
    return writer


def stored(attempt: Attempt) -> list[LogLine]:
    return list(LogLine.objects.filter(attempt=attempt).order_by("seq"))


@pytest.mark.django_db(transaction=True)
def test_it_stores_lines_numbered_from_one_with_their_parsed_fields(attempt):
    write(attempt, [b"hello\n", b"[ERROR] disk full\n", b"caf\xc3\xa9 \xff\n", b"NCCL WARN socket closed\n"])

    lines = stored(attempt)
    assert [line.seq for line in lines] == [1, 2, 3, 4]
    assert [line.text for line in lines] == ["hello", "[ERROR] disk full", "café \ufffd", "NCCL WARN socket closed"]
    assert [line.severity for line in lines] == [Severity.INFO, Severity.ERROR, Severity.INFO, Severity.WARNING]
    assert [line.fault for line in lines] == [False, False, False, True]
    assert {(line.job_id, line.node_id, line.rank, line.stream) for line in lines} == {
        (attempt.job_id, attempt.node_id, 0, Stream.STDOUT)
    }


@pytest.mark.django_db(transaction=True)
def test_hangars_own_line_waits_briefly_for_the_jobs_first_output_and_the_jobs_lines_never_wait(attempt, monkeypatch):
    monkeypatch.setattr(logingest, "SYSTEM_LINGER_SECONDS", 1.0)  # long enough for a loaded machine
    q: queue.Queue = queue.Queue()
    writer = LogWriter(attempt, q)
    writer.start()
    writer.system("[hangar] attempt 1 on node-a", False)
    time.sleep(0.1)
    assert not stored(attempt)  # held for the job's first line
    q.put((Stream.STDOUT, timezone.now(), b"hello\n", False))
    deadline = time.monotonic() + 5
    while len(stored(attempt)) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [line.text for line in stored(attempt)] == ["[hangar] attempt 1 on node-a", "hello"]
    assert writer.batches == 1  # one write for both

    q.put((Stream.STDOUT, timezone.now(), b"step 1\n", False))  # a job's line alone goes at once
    while len(stored(attempt)) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert writer.batches == 2
    writer.system("[hangar] the job exited with code 0", False)  # alone, it waits no more than the linger
    while len(stored(attempt)) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    writer.close()
    assert [line.text for line in stored(attempt)][2:] == ["step 1", "[hangar] the job exited with code 0"]
    assert writer.batches == 3


@pytest.mark.django_db(transaction=True)
def test_a_line_over_the_limit_is_stored_cut_with_a_marker(attempt, settings):
    settings.HANGAR_LOG_LINE_MAX_BYTES = 256
    q: queue.Queue = queue.Queue()
    writer = LogWriter(attempt, q)
    writer.start()
    import io

    writer.expect_streams(1)
    logingest.read_lines(io.BytesIO(b"short\n" + b"x" * 1000 + b"\n\xff\xfe tail\n"), Stream.STDERR, q)
    writer.close()

    texts = [line.text for line in stored(attempt)]
    assert texts == ["short", "x" * 256 + TRUNCATION_MARKER, "\ufffd\ufffd tail"]


def four_ranks(attempt: Attempt, node_b) -> Attempt:
    """The attempt placed as four ranks, two on each node (its writers are not its only one)."""
    nodes = [attempt.node, node_b]
    attempt.placement = [
        {"rank": r, "node_id": nodes[r % 2].pk, "node": nodes[r % 2].name, "gpus": [r // 2]} for r in range(4)
    ]
    attempt.save(update_fields=["placement"])
    return attempt


@pytest.mark.django_db(transaction=True)
def test_ranks_on_several_nodes_share_one_gap_free_sequence(attempt):
    node_b = make_node("node-b")
    attempt = four_ranks(attempt, node_b)
    per_rank = 300
    writers = [
        threading.Thread(
            target=write,
            args=(attempt, [f"rank {rank} line {i}\n".encode() for i in range(per_rank)]),
            kwargs={"rank": rank, "node_id": node_b.pk if rank % 2 else None},
        )
        for rank in range(4)
    ]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()

    lines = stored(attempt)
    assert [line.seq for line in lines] == list(range(1, 4 * per_rank + 1))
    for rank in range(4):
        mine = [line for line in lines if line.rank == rank]
        assert [line.text for line in mine] == [f"rank {rank} line {i}" for i in range(per_rank)]
        assert {line.node_id for line in mine} == {node_b.pk if rank % 2 else attempt.node_id}


@pytest.mark.django_db(transaction=True)
def test_lines_printed_before_the_rank_learned_its_attempt_ended_are_stored_late_and_later_ones_refused(attempt):
    """A write that hung through a partition finds the attempt ended (lease): what the rank printed
    until then is its output, stored late into its attempt; what it prints after being told is
    refused (the fence) while its runner stops it."""
    q: queue.Queue = queue.Queue()
    writer = LogWriter(attempt, q)
    printed = timezone.now()
    Attempt.objects.filter(pk=attempt.pk).update(state="lost")  # ended elsewhere while the write hung
    writer.start()
    q.put((Stream.STDOUT, printed, b"printed while cut off\n", False))
    deadline = time.monotonic() + 5
    while not writer.refused and not writer.late_lines and time.monotonic() < deadline:
        time.sleep(0.01)
    q.put((Stream.STDOUT, timezone.now(), b"printed after the rank was told\n", False))
    writer.close()

    texts = [line.text for line in stored(attempt)]
    assert texts[0] == "printed while cut off" and "printed after the rank was told" not in texts
    assert "ended elsewhere before its last 1 lines" in texts[-1] and "stored late" in texts[-1]
    assert writer.refused


@pytest.mark.django_db(transaction=True)
def test_lines_wait_on_disk_while_the_database_is_down_and_none_is_lost(attempt, monkeypatch):
    real = logingest.store_lines
    down = threading.Event()
    down.set()
    calls = []

    def flaky(attempt_id, rows, **kwargs):
        calls.append(len(rows))
        if down.is_set():
            raise OperationalError("connection refused")
        return real(attempt_id, rows, **kwargs)

    monkeypatch.setattr(logingest, "store_lines", flaky)
    q: queue.Queue = queue.Queue()
    writer = LogWriter(attempt, q)
    writer.start()
    for i in range(50):
        q.put((Stream.STDOUT, timezone.now(), f"line {i}\n".encode(), False))
    deadline = timezone.now().timestamp() + 5
    while not writer.spool and timezone.now().timestamp() < deadline:
        threading.Event().wait(0.01)
    assert writer.spool.path.exists()
    for i in range(50, 100):
        q.put((Stream.STDOUT, timezone.now(), f"line {i}\n".encode(), False))
    assert stored(attempt) == []

    down.clear()
    writer.close()

    lines = stored(attempt)
    assert [line.text for line in lines] == [f"line {i}" for i in range(100)]
    assert [line.seq for line in lines] == list(range(1, 101))
    assert not writer.spool.path.exists()


# --- idempotent storage and spools left by a dead agent ------------------------------


def new_lines(attempt: Attempt, texts: list[str], rank: int = 0) -> list[logingest.NewLine]:
    now = timezone.now()
    return [
        logingest.NewLine(
            attempt.job_id, attempt.pk, attempt.node_id, rank, Stream.STDOUT, Severity.INFO, False, now, t, i
        )
        for i, t in enumerate(texts, start=1)
    ]


@pytest.mark.django_db(transaction=True)
def test_the_same_batch_sent_twice_is_stored_once(attempt):
    texts = [f"line {i}" for i in range(100)]
    logingest.store_lines(attempt.pk, new_lines(attempt, texts[:60]))

    last = logingest.store_lines(attempt.pk, new_lines(attempt, texts))  # a resend of 60, then 40 new

    lines = stored(attempt)
    assert [line.text for line in lines] == texts
    assert [line.seq for line in lines] == list(range(1, 101))
    assert last == 100


def test_a_fresh_batch_skips_the_look_for_stored_lines_and_a_resent_one_does_not(attempt, django_assert_num_queries):
    """A live writer's first try of a batch cannot find any of it stored: one statement fewer
    per batch on the short-job path. Sent again (its commit may have happened), it is checked."""
    texts = [f"line {i}" for i in range(10)]
    # Inside the test's transaction: a savepoint and its release, the fence, the last seq, the insert.
    with django_assert_num_queries(5):
        logingest.store_lines(attempt.pk, new_lines(attempt, texts), fresh=True)
    with django_assert_num_queries(5):  # the look for stored lines finds them all: no insert
        last = logingest.store_lines(attempt.pk, new_lines(attempt, texts))

    assert last == 10 and [line.text for line in stored(attempt)] == texts


def test_the_only_writer_numbers_from_the_last_seq_it_was_given(attempt, django_assert_num_queries):
    first, second = new_lines(attempt, ["a", "b", "c"])[:2], new_lines(attempt, ["a", "b", "c"])[2:]
    logingest.store_lines(attempt.pk, first, fresh=True)
    # Inside the test's transaction: a savepoint and its release, the fence and the insert: no look
    # for the last seq, the writer says it.
    with django_assert_num_queries(4):
        last = logingest.store_lines(attempt.pk, second, fresh=True, last=2)

    assert last == 3 and [(line.seq, line.text) for line in stored(attempt)] == [(1, "a"), (2, "b"), (3, "c")]


@pytest.mark.django_db(transaction=True)
def test_a_one_rank_attempts_writer_gives_the_last_seq_it_stored_and_a_rank_of_several_does_not(attempt, monkeypatch):
    real, given = logingest.store_lines, []

    def recording(attempt_id, rows, **kwargs):
        given.append((rows[0].rank, kwargs.get("last")))
        return real(attempt_id, rows, **kwargs)

    monkeypatch.setattr(logingest, "store_lines", recording)
    q: queue.Queue = queue.Queue()
    writer = LogWriter(attempt, q)
    writer.start()
    q.put((Stream.STDOUT, timezone.now(), b"one\n", False))
    deadline = time.monotonic() + 10
    while writer.batches < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    q.put((Stream.STDOUT, timezone.now(), b"two\n", False))
    writer.close()
    assert given == [(0, 0), (0, 1)]  # its first batch with none stored, its second after seq 1

    given.clear()
    attempt = four_ranks(attempt, make_node("node-b"))
    write(attempt, [b"three\n"], rank=1)
    assert given == [(1, None)]  # the other ranks' writers number lines of the same attempt


@pytest.mark.django_db(transaction=True)
def test_a_batch_whose_commit_was_not_acknowledged_is_not_stored_twice(attempt, monkeypatch):
    real = logingest.store_lines
    dropped = []

    def commits_then_drops(attempt_id, rows, **kwargs):
        seq = real(attempt_id, rows, **kwargs)
        if not dropped:  # the COMMIT went through, its answer never came back
            dropped.append(len(rows))
            raise OperationalError("server closed the connection unexpectedly")
        return seq

    monkeypatch.setattr(logingest, "store_lines", commits_then_drops)
    writer = write(attempt, [f"line {i}\n".encode() for i in range(200)])

    assert dropped
    assert [line.text for line in stored(attempt)] == [f"line {i}" for i in range(200)]
    assert [line.seq for line in stored(attempt)] == list(range(1, 201))
    assert not writer.spool.path.exists()


def spool_and_die(attempt: Attempt, lines: list[bytes], monkeypatch, settings) -> LogWriter:
    """A writer that finds the database unreachable and gives up at once, as if its agent died."""
    settings.HANGAR_LOG_SPOOL_FLUSH_SECONDS = 0
    with monkeypatch.context() as patch:
        patch.setattr(logingest, "store_lines", lambda *a, **k: (_ for _ in ()).throw(OperationalError("refused")))
        writer = write(attempt, lines)
    assert writer.spool.path.exists()
    return writer


@pytest.mark.django_db(transaction=True)
def test_lines_spooled_by_an_agent_that_died_are_stored_when_its_node_agent_starts(attempt, monkeypatch, settings):
    from agent.node import Agent
    from fleet.gpus import SimulatedProvider

    writer = spool_and_die(attempt, [f"line {i}\n".encode() for i in range(120)], monkeypatch, settings)
    with open(writer.spool.path, "a") as spool:
        spool.write('[1, 2, "cut off in mid-wri')  # the agent died while appending

    Agent(attempt.node.name, SimulatedProvider(attempt.node.name, "H100", 4), 1.0).register()

    attempt.refresh_from_db()
    assert attempt.state == "lost"  # ended by the new agent, and its lines are still the truth
    assert [line.text for line in stored(attempt)] == [f"line {i}" for i in range(120)]
    assert [line.seq for line in stored(attempt)] == list(range(1, 121))
    assert not writer.spool.path.exists()


@pytest.mark.django_db(transaction=True)
def test_a_spool_its_writer_gave_up_on_is_sent_by_the_next_heartbeat_and_a_live_writers_never(
    attempt, monkeypatch, settings
):
    """A rank that ended while the database was still away leaves its lines on disk; before,
    only the agent's next start sent them. A live writer's spool is its own storer's."""
    from agent.node import Agent
    from fleet.gpus import SimulatedProvider

    agent = Agent(attempt.node.name, SimulatedProvider(attempt.node.name, "H100", 4), 0.05)
    agent.register()
    Attempt.objects.filter(pk=attempt.pk).update(state="running")
    given_up = spool_and_die(attempt, [f"line {i}\n".encode() for i in range(30)], monkeypatch, settings)
    other = make_attempt(make_job(attempt.job.project, attempt.job.submitted_by), attempt.node, "running")
    live = LogWriter(other, queue.Queue(), rank=0)
    live.spool.append(new_lines(other, ["its own"]))
    logingest.LIVE_SPOOLS.add(live.spool.path)  # as its run() does
    try:
        stop = threading.Event()
        beating = threading.Thread(target=agent.heartbeat_forever, args=(stop,))
        beating.start()
        deadline = time.monotonic() + 10
        while given_up.spool.path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        beating.join()
    finally:
        logingest.LIVE_SPOOLS.discard(live.spool.path)

    assert [line.text for line in stored(attempt)] == [f"line {i}" for i in range(30)]
    assert not given_up.spool.path.exists()
    assert live.spool.path.exists() and not stored(other)


@pytest.mark.django_db(transaction=True)
def test_a_writer_that_starts_spooling_while_spools_are_replayed_keeps_its_file(attempt, monkeypatch, settings):
    given_up = spool_and_die(attempt, [f"line {i}\n".encode() for i in range(3)], monkeypatch, settings)
    later = make_attempt(make_job(attempt.job.project, attempt.job.submitted_by), attempt.node, "running")
    starting = LogWriter(later, queue.Queue(), rank=0)
    folder = logingest.spool_dir

    def folder_as_a_writer_starts_and_spools(node_id):
        # The replay has begun: a rank starts now and cannot reach the database.
        logingest.LIVE_SPOOLS.add(starting.spool.path)  # as its run() does, before any line
        starting.spool.append(new_lines(later, ["its own"]))
        return folder(node_id)

    monkeypatch.setattr(logingest, "spool_dir", folder_as_a_writer_starts_and_spools)
    try:
        assert logingest.replay_spools(attempt.node_id) == 1
    finally:
        logingest.LIVE_SPOOLS.discard(starting.spool.path)
    assert [line.text for line in stored(attempt)] == ["line 0", "line 1", "line 2"]
    assert not given_up.spool.path.exists()
    assert starting.spool.path.exists() and not stored(later)  # its storer's to send, not the replay's


@pytest.mark.django_db(transaction=True)
def test_replaying_a_spool_already_partly_stored_stores_nothing_twice(attempt, monkeypatch, settings):
    writer = spool_and_die(attempt, [f"line {i}\n".encode() for i in range(50)], monkeypatch, settings)
    logingest.store_lines(attempt.pk, new_lines(attempt, [f"line {i}" for i in range(20)]))

    assert logingest.replay_spools(attempt.node_id) == 1

    assert [line.text for line in stored(attempt)] == [f"line {i}" for i in range(50)]
    assert not writer.spool.path.exists()


@pytest.mark.django_db(transaction=True)
def test_spooled_lines_of_an_attempt_that_no_longer_exists_are_dropped(attempt, monkeypatch, settings):
    writer = spool_and_die(attempt, [b"orphan\n"], monkeypatch, settings)
    Attempt.objects.filter(pk=attempt.pk).delete()

    assert logingest.replay_spools(attempt.node_id) == 1

    assert not LogLine.objects.exists()
    assert not writer.spool.path.exists()


STREAM = b"short\r\n" + b"x" * 40 + b"\n\n" + b"y" * 10 + b"\n" + b"z" * 25 + b"\ntail"


@pytest.mark.parametrize("size", [1, 3, 7, 16, 1000])
def test_lines_are_cut_at_the_limit_however_the_pipe_delivers_them(size):
    splitter = logingest.LineSplitter(limit=20)
    lines = []
    for start in range(0, len(STREAM), size):
        lines += splitter.feed(STREAM[start : start + size])
    lines += splitter.end()

    assert lines == [
        (b"short\r", False),
        (b"x" * 20, True),
        (b"", False),
        (b"y" * 10, False),
        (b"z" * 20, True),
        (b"tail", False),
    ]


@pytest.mark.django_db(transaction=True)
def test_a_spool_file_that_cannot_be_read_stays_and_does_not_stop_the_others(attempt, monkeypatch, settings):
    writer = spool_and_die(attempt, [b"kept\n"], monkeypatch, settings)
    unreadable = writer.spool.path.with_name("attempt-999-rank-0.jsonl")
    unreadable.write_text('[1, 2, 3, 0, 1, 20, false, "2026-11-29T12:00:00+00:00", "old format"]\n')

    assert logingest.replay_spools(attempt.node_id) == 1

    assert [line.text for line in stored(attempt)] == ["kept"]
    assert unreadable.exists()


@pytest.mark.django_db(transaction=True)
def test_streams_that_end_before_they_are_expected_still_count(attempt):
    """A process that exits at once: its readers' ends reach the writer before the runner said
    how many streams to expect (the runner then waited 2 s, SIGKILLed, and waited 5 s more)."""
    q: queue.Queue = queue.Queue()
    writer = LogWriter(attempt, q)
    writer.start()
    q.put((Stream.STDOUT, None, None, False))
    q.put((Stream.STDERR, None, None, False))
    deadline = time.monotonic() + 5
    while writer.open_streams > -2 and time.monotonic() < deadline:  # both ends parsed
        time.sleep(0.01)

    writer.expect_streams(2)

    assert writer.wait_for_streams(timeout=0.5)
    writer.close()


@pytest.mark.django_db(transaction=True)
def test_a_writer_reading_pipes_that_are_already_closed_sees_their_ends_at_once(attempt):
    writer = LogWriter(attempt, queue.Queue())
    writer.start()
    pipes = []
    for stream in (Stream.STDOUT, Stream.STDERR):
        read, write = os.pipe()
        os.write(write, b"bye\n")
        os.close(write)
        pipes.append((os.fdopen(read, "rb"), stream))  # buffered, as subprocess gives them

    writer.read_from(pipes, writer.lines)

    assert writer.wait_for_streams(timeout=2)
    writer.close()
    assert [line.text for line in stored(attempt)] == ["bye", "bye"]


@pytest.mark.django_db(transaction=True)
def test_lines_spooled_while_cut_off_are_stored_late_into_an_attempt_that_ended_meanwhile(attempt, monkeypatch):
    """A partition: the rank spools what it prints, its attempt is ended elsewhere (lease), the
    link comes back. Those lines were refused and discarded; they are what the rank printed."""
    real = logingest.store_lines
    down = threading.Event()
    down.set()

    def partitioned(attempt_id, rows, **kwargs):
        if down.is_set():
            raise OperationalError("no route to host")
        return real(attempt_id, rows, **kwargs)

    monkeypatch.setattr(logingest, "store_lines", partitioned)
    q: queue.Queue = queue.Queue()
    writer = LogWriter(attempt, q)
    writer.start()
    for i in range(30):
        q.put((Stream.STDOUT, timezone.now(), f"step {i}\n".encode(), False))
    deadline = time.monotonic() + 5
    while not writer.spool and time.monotonic() < deadline:
        time.sleep(0.01)
    Attempt.objects.filter(pk=attempt.pk).update(state="lost")  # the reconciler, on the other side

    down.clear()
    writer.close()

    lines = stored(attempt)
    assert [line.text for line in lines[:30]] == [f"step {i}" for i in range(30)]  # each once, in order
    assert len(lines) == 31 and lines[-1].stream == Stream.SYSTEM and lines[-1].severity == Severity.WARNING
    assert "could not reach the database from" in lines[-1].text and "the 30 lines it printed" in lines[-1].text
    assert [line.seq for line in lines] == list(range(1, 32))
    assert not writer.refused and not writer.spool.path.exists()


COPY_REFUSED = textwrap.dedent(
    """
    import django
    django.setup()
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    from django.db import DatabaseError, connection
    from django.utils import timezone
    from agent import output
    from jobs.logstore import COPY_MIN_ROWS
    from jobs.models import LogLine
    from tests.factories import make_attempt, make_job, make_node, make_project, make_user
    from tests.test_logs_ingest import new_lines
    assert connection.vendor == "postgresql", connection.vendor
    user = make_user("ada"); project = make_project("vision", admin=user)
    attempt = make_attempt(make_job(project, user), make_node("node-a"), "running", running_at=timezone.now())
    texts = [f"line {i}" for i in range(COPY_MIN_ROWS)]
    output.store_lines(attempt.pk, new_lines(attempt, texts), fresh=True)
    try:  # the same lines again, said to be new, through COPY: the constraints refuse them
        output.store_lines(attempt.pk, new_lines(attempt, texts), fresh=True)
    except DatabaseError as exc:
        print("refused as", type(exc).__name__)
    assert LogLine.objects.filter(attempt=attempt).count() == COPY_MIN_ROWS
    """
)


def test_a_copy_the_database_refuses_is_a_database_error_the_writer_spools_on():
    """Large batches go in by COPY on PostgreSQL, through the driver's cursor: its error must be
    Django's, which the writer spools on (its storer thread died of the driver's own, lines lost)."""
    from tests.factories import on_postgresql

    run = on_postgresql(COPY_REFUSED)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "refused as IntegrityError" in run.stdout


ONE_STATEMENT = textwrap.dedent(
    """
    import threading, time
    import django
    django.setup()
    from django.core.management import call_command
    call_command("migrate", verbosity=0)
    import psycopg
    from django.conf import settings
    from django.db import DatabaseError, connection, transaction
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone
    from jobs import logstore
    from jobs.models import LogLine
    from tests.factories import make_attempt, make_job, make_node, make_project, make_user
    from tests.test_logs_ingest import new_lines
    assert connection.vendor == "postgresql", connection.vendor
    user = make_user("ada"); project = make_project("vision", admin=user)
    node = make_node("node-a")
    attempt = make_attempt(make_job(project, user), node, "running", running_at=timezone.now())
    texts = lambda attempt: [row.text for row in LogLine.objects.filter(attempt=attempt).order_by("seq")]

    # A live writer's fresh batch, its last seq known: one statement, no transaction of its own.
    rows = new_lines(attempt, ["a", "b", "c"])
    rows[1].node_id = None  # a value of another type than the first row's: cast, not guessed
    with CaptureQueriesContext(connection) as queries:
        assert logstore.store_lines(attempt.pk, rows[:2], fresh=True, last=0) == 2
    print("statements", len(queries), queries[0]["sql"].split()[0])
    assert logstore.store_lines(attempt.pk, rows[2:], fresh=True, last=2) == 3
    assert texts(attempt) == ["a", "b", "c"]
    assert [r.node_id for r in LogLine.objects.filter(attempt=attempt).order_by("seq")] == [node.pk, None, node.pk]

    # A seq already taken (a wrong `last`): refused whole, as the transaction's insert was.
    try:
        logstore.store_lines(attempt.pk, new_lines(attempt, ["x", "y"]), fresh=True, last=1)
    except DatabaseError as exc:
        print("wrong last refused as", type(exc).__name__)
    assert texts(attempt) == ["a", "b", "c"]
    # In a caller's transaction the batch keeps its savepoint: refused, it leaves the transaction usable.
    with transaction.atomic():
        try:
            logstore.store_lines(attempt.pk, new_lines(attempt, ["x"]), fresh=True, last=1)
        except DatabaseError:
            pass
        print("caller's transaction usable", len(texts(attempt)))
    # A job's line is a value, never SQL: stored as printed, whatever it holds.
    hostile = "it's \\\\ 'quoted' %s %(x)s $1 ); DELETE FROM jobs_logline; --"
    rows = new_lines(attempt, ["a", "b", "c", hostile])[3:]
    assert logstore.store_lines(attempt.pk, rows, fresh=True, last=3) == 4
    assert texts(attempt) == ["a", "b", "c", hostile]

    # An attempt that ended: refused, nothing stored.
    ended = make_attempt(make_job(project, user), node, "succeeded")
    try:
        logstore.store_lines(ended.pk, new_lines(ended, ["late"]), fresh=True, last=0)
    except logstore.AttemptNotCurrent:
        print("ended attempt refused")
    assert texts(ended) == []

    # The fence: an end being written holds the attempt's row; the batch waits for it, then is refused.
    running = make_attempt(make_job(project, user), node, "running", running_at=timezone.now())
    url = settings.DATABASES["default"]
    other = psycopg.connect(
        dbname=url["NAME"], user=url["USER"], host=url["HOST"], port=url["PORT"] or 5432, password=url["PASSWORD"]
    )
    other.execute("UPDATE jobs_attempt SET state = 'succeeded' WHERE id = %s", [running.pk])
    outcome = []

    def batch():
        try:
            logstore.store_lines(running.pk, new_lines(running, ["raced"]), fresh=True, last=0)
            outcome.append("stored")
        except logstore.AttemptNotCurrent:
            outcome.append("refused")
        finally:
            connection.close()

    thread = threading.Thread(target=batch)
    thread.start()
    time.sleep(0.5)
    print("waited for the end", thread.is_alive())
    other.commit()
    thread.join(10)
    print("raced batch", outcome)
    assert texts(running) == []
    """
)


def test_a_live_writers_batch_is_one_statement_on_postgresql_and_keeps_the_fence():
    """On PostgreSQL a live writer's batch (nothing to skip, its last seq known) is one INSERT whose
    fence (the attempt started, its row locked) is in the statement: one round trip instead of four,
    and the attempt's row is not held across the writer's round trips. It still refuses a batch for
    an ended attempt, waits for an end being written and is then refused, stores a wrong `last`'s
    batch nowhere (in a caller's transaction, in a savepoint that leaves it usable), stores a line
    that looks like SQL as it was printed, and takes a NULL after a number in one column."""
    from tests.factories import on_postgresql

    run = on_postgresql(ONE_STATEMENT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "statements 1 INSERT" in run.stdout
    assert "wrong last refused as IntegrityError" in run.stdout
    assert "ended attempt refused" in run.stdout and "caller's transaction usable 3" in run.stdout
    assert "waited for the end True" in run.stdout and "raced batch ['refused']" in run.stdout
