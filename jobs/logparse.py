"""Turning a job's raw output into log lines: decoding, truncation, severity."""

import re

from jobs.models import Severity, Stream

TRUNCATION_MARKER = " …[line truncated by Hangar]"

_LEVEL_WORDS = {
    "CRITICAL": Severity.CRITICAL,
    "FATAL": Severity.CRITICAL,
    "ERROR": Severity.ERROR,
    "WARNING": Severity.WARNING,
    "WARN": Severity.WARNING,
    "INFO": Severity.INFO,
    "DEBUG": Severity.DEBUG,
}
# "ERROR:root:...", "[ERROR] ...", "2026-11-29 12:00:00,123 WARNING ...",
# "host:1234:5678 [0] NCCL WARN ...": the level word may follow only a timestamp,
# a host:pid:tid or a [rank] prefix, so "my ERROR count is 0" stays INFO.
_LEVEL_RE = re.compile(
    r"^(?:(?:\d[\d\-/:.,T]*|\S+:\d+:\d+|\[\d+\])\s+){0,3}(?:NCCL\s+)?"
    r"\[?(CRITICAL|FATAL|ERROR|WARNING|WARN|INFO|DEBUG)\]?(?:[:\s]|$)"
)
# glog: "W1129 12:00:00.000000 1234 file.cc:12] ..."
_GLOG_RE = re.compile(r"^([IWEF])\d{4} \d{2}:\d{2}:\d{2}")
_GLOG_LEVELS = {"I": Severity.INFO, "W": Severity.WARNING, "E": Severity.ERROR, "F": Severity.CRITICAL}


def decode_line(raw: bytes, truncated: bool) -> str:
    """Bytes of one line as safe text: invalid UTF-8 and NULs replaced, marker when cut."""
    text = raw.rstrip(b"\n").rstrip(b"\r").decode("utf-8", errors="replace").replace("\x00", "\ufffd")
    return text + TRUNCATION_MARKER if truncated else text


def severity_of(text: str, stream: int) -> int:
    """The level a line states for itself, else INFO on stdout and WARNING on stderr."""
    if match := _LEVEL_RE.match(text):
        return _LEVEL_WORDS[match.group(1)]
    if match := _GLOG_RE.match(text):
        return _GLOG_LEVELS[match.group(1)]
    if text.startswith("Traceback (most recent call last)"):
        return Severity.ERROR
    return Severity.WARNING if stream == Stream.STDERR else Severity.INFO


# NCCL, GPU driver (Xid), CUDA and ECC faults: the line that explains a crash
# even when the program printed it at a harmless level.
_FAULT_RE = re.compile(
    r"NCCL (?:WARN|ERROR)|ncclSystemError|ncclInternalError|ncclUnhandledCudaError|NCCL error"
    r"|\bXid\b|CUDA error|CUDA_ERROR_\w+|cudaError\w+|uncorrectable ECC|ECC error|illegal memory access"
)


_FAULT_WORDS = ("NCCL", "nccl", "Xid", "CUDA", "cuda", "ECC", "illegal memory")


def is_fault(text: str) -> bool:
    """The line names an NCCL, Xid, CUDA or ECC fault."""
    # Substring tests first: the regex costs a few microseconds on every line of a flood.
    return any(word in text for word in _FAULT_WORDS) and _FAULT_RE.search(text) is not None


_TRACEBACK_START = "Traceback (most recent call last)"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class SeverityReader:
    """Severity of each line of one stream, keeping a Python traceback together as one ERROR block.

    A traceback runs from "Traceback (most recent call last):" over its
    indented frames to the exception line ("ValueError: ..."), which ends it;
    chained tracebacks ("During handling of ...") continue the block.
    """

    def __init__(self, stream: int):
        self.stream = stream
        self.in_traceback = False
        self.after_traceback = False  # a blank line then "During handling ..." chains another

    def __call__(self, text: str) -> int:
        # A line naming an NCCL/Xid/CUDA/ECC fault is at least a warning, whatever level it
        # printed itself at: a severity >= WARNING filter must not hide the line a health event cites.
        level = self.level(text)
        return max(level, Severity.WARNING) if level < Severity.WARNING and is_fault(text) else level

    def level(self, text: str) -> int:
        if text.startswith(_TRACEBACK_START) or (self.after_traceback and text.startswith(_CHAINED)):
            self.in_traceback, self.after_traceback = True, False
            return Severity.ERROR
        if self.in_traceback:
            if text[:1] in (" ", "\t") or text.startswith(_CHAINED) or not text.strip():
                return Severity.ERROR
            self.in_traceback, self.after_traceback = False, True  # the exception line closes the block
            return max(Severity.ERROR, severity_of(text, self.stream))
        if self.after_traceback and not text.strip():
            return Severity.ERROR
        self.after_traceback = False
        return severity_of(text, self.stream)
