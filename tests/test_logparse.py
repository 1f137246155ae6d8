"""Turning raw job output into log lines: severity, decoding, and the per-line size limit."""

import io
import queue

import pytest

from agent.output import read_lines
from jobs.logparse import TRUNCATION_MARKER, SeverityReader, decode_line, severity_of
from jobs.models import Severity, Stream


@pytest.mark.parametrize(
    ("text", "severity"),
    [
        ("ERROR:root:boom", Severity.ERROR),
        ("WARNING:torch.distributed:slow", Severity.WARNING),
        ("[WARNING] x", Severity.WARNING),
        ("[ERROR] disk full", Severity.ERROR),
        ("2026-11-29 12:00:00,123 INFO started", Severity.INFO),
        ("2026-11-29 12:00:00,123 DEBUG details", Severity.DEBUG),
        ("CRITICAL: out of memory", Severity.CRITICAL),
        ("FATAL: cannot continue", Severity.CRITICAL),
        ("W1129 12:00:00.000000 1234 f.cc:1] slow", Severity.WARNING),
        ("E1129 12:00:00.000000 1234 f.cc:1] failed", Severity.ERROR),
        ("F1129 12:00:00.000000 1234 f.cc:1] check failed", Severity.CRITICAL),
        ("I1129 12:00:00.000000 1234 f.cc:1] hello", Severity.INFO),
        ("NCCL WARN Call to connect returned Connection refused", Severity.WARNING),
        ("node1:1234:5678 [0] NCCL WARN Call to connect returned Connection refused", Severity.WARNING),
        ("node1:1234:5678 [0] NCCL INFO Bootstrap : Using eth0", Severity.INFO),
        ("Traceback (most recent call last):", Severity.ERROR),
    ],
)
def test_it_reads_the_level_a_line_states(text, severity):
    assert severity_of(text, Stream.STDOUT) == severity
    assert severity_of(text, Stream.STDERR) == severity


def test_a_plain_stdout_line_is_info():
    assert severity_of("epoch 1 loss 0.53", Stream.STDOUT) == Severity.INFO


def test_a_plain_stderr_line_is_a_warning():
    assert severity_of("epoch 1 loss 0.53", Stream.STDERR) == Severity.WARNING


@pytest.mark.parametrize(
    "text",
    ["INFORMATION follows", "ERRORS=0", "warning: lower case is not a level", "", "my ERROR count is zero"],
)
def test_a_level_word_only_counts_as_a_whole_word(text):
    assert severity_of(text, Stream.STDOUT) == Severity.INFO


def test_it_replaces_invalid_utf8():
    assert decode_line(b"caf\xc3\xa9 \xff\xfe ok\n", truncated=False) == "café \ufffd\ufffd ok"


def test_it_replaces_nul_characters():
    assert decode_line(b"a\x00b\n", truncated=False) == "a\ufffdb"


@pytest.mark.parametrize("raw", [b"done\r\n", b"done\n", b"done"])
def test_it_strips_the_line_ending(raw):
    assert decode_line(raw, truncated=False) == "done"


def test_it_keeps_a_carriage_return_inside_a_line():
    assert decode_line(b"10%\r20%\n", truncated=False) == "10%\r20%"


def test_it_marks_a_truncated_line():
    text = decode_line(b"x" * 10, truncated=True)

    assert text == "x" * 10 + TRUNCATION_MARKER
    assert "truncated" in TRUNCATION_MARKER


# --- read_lines: one pipe into the writer's queue -----------------------------------


def drain(pipe_bytes: bytes, stream: int = Stream.STDOUT) -> tuple[list[tuple], io.BytesIO]:
    pipe = io.BytesIO(pipe_bytes)
    out: queue.Queue = queue.Queue()
    read_lines(pipe, stream, out)
    items = []
    while not out.empty():
        stream, ts, raw, flag = out.get_nowait()
        # The lines of one read come as one item; one entry per line here. Newlines are cut off.
        if raw is None:
            items.append((stream, ts, raw, flag))
        else:
            items.extend((stream, ts, line, cut) for line, cut in raw)
    return items, pipe


def test_it_reads_every_line_of_a_pipe_then_a_sentinel(settings):
    settings.HANGAR_LOG_LINE_MAX_BYTES = 256

    items, pipe = drain(b"one\ntwo\r\n\nlast without newline", Stream.STDERR)

    assert [(stream, raw, flag) for stream, _, raw, flag in items[:-1]] == [
        (Stream.STDERR, b"one", False),
        (Stream.STDERR, b"two\r", False),
        (Stream.STDERR, b"", False),
        (Stream.STDERR, b"last without newline", False),
    ]
    assert all(ts is not None for _, ts, _, _ in items[:-1])
    assert items[-1] == (Stream.STDERR, None, None, False)
    assert pipe.closed


def test_a_line_over_the_limit_becomes_one_truncated_entry(settings):
    settings.HANGAR_LOG_LINE_MAX_BYTES = 256

    items, _ = drain(b"before\n" + b"x" * 1000 + b"\nafter\n")

    entries = [(raw, flag) for _, _, raw, flag in items[:-1]]
    assert entries == [(b"before", False), (b"x" * 256, True), (b"after", False)]
    assert items[-1] == (Stream.STDOUT, None, None, False)


def test_a_long_last_line_without_newline_is_truncated_once(settings):
    settings.HANGAR_LOG_LINE_MAX_BYTES = 256

    items, _ = drain(b"ok\n" + b"y" * 600)

    entries = [(raw, flag) for _, _, raw, flag in items[:-1]]
    assert entries == [(b"ok", False), (b"y" * 256, True)]


def test_a_line_just_under_the_limit_is_whole(settings):
    settings.HANGAR_LOG_LINE_MAX_BYTES = 256
    line = b"z" * 255

    items, _ = drain(line + b"\nnext\n")

    assert [(raw, flag) for _, _, raw, flag in items[:-1]] == [(line, False), (b"next", False)]


def test_an_empty_pipe_gives_only_the_sentinel():
    items, _ = drain(b"")

    assert items == [(Stream.STDOUT, None, None, False)]


def test_a_line_naming_a_fault_is_at_least_a_warning_whatever_level_it_printed():
    read = SeverityReader(Stream.STDOUT)

    assert read("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.") == Severity.WARNING
    assert read("INFO NCCL WARN Call to ibv_post_send failed") == Severity.WARNING
    assert read("ERROR CUDA error: an illegal memory access was encountered") == Severity.ERROR
    assert read("epoch 3 loss 0.12") == Severity.INFO
