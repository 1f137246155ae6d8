"""Bounds on requests that wait or stream: long polls, downloads, log websockets.

A long poll (`logs?follow=1&wait=N`) holds one of the web process's HANGAR_WEB_THREADS
request threads while it waits: eight of one member's made another user's request wait
23 s. Each kind of waiting request is counted per user and per process, and one over
either bound is answered at once (429 with Retry-After, or a websocket close) instead
of waiting for a thread. Long polls may take at most half of the request threads, so
the other half is always free for short requests.

Counts are this process's own (each web process has its own threads to protect).
"""

import threading
from collections import Counter
from contextlib import contextmanager

from django.conf import settings
from rest_framework import exceptions, status

RETRY_AFTER_SECONDS = 2


class Busy(exceptions.APIException):
    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_code = "busy"

    def __init__(self, message: str, wait: int = RETRY_AFTER_SECONDS):
        super().__init__(message)
        self.wait = wait  # DRF's exception handler sends it as Retry-After


def limits(kind: str) -> tuple[int, int]:
    """(per user, per process) for `kind`."""
    if kind == "long_poll":
        per_process = settings.HANGAR_LONG_POLLS_PER_PROCESS or max(1, settings.HANGAR_WEB_THREADS // 2)
        per_process = min(per_process, max(1, settings.HANGAR_WEB_THREADS - 1))
        return settings.HANGAR_LONG_POLLS_PER_USER, per_process
    return settings.HANGAR_STREAMS_PER_USER, settings.HANGAR_STREAMS_PER_PROCESS


class Slots:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_user: Counter = Counter()
        self.by_kind: Counter = Counter()

    def take(self, kind: str, user_id) -> str | None:
        """Take a slot; None when taken, else why not."""
        per_user, per_process = limits(kind)
        with self.lock:
            if self.by_user[kind, user_id] >= per_user:
                return f"you have {per_user} {describe(kind)} open already, the most one user may"
            if self.by_kind[kind] >= per_process:
                return f"this server has its {per_process} {describe(kind)} open already"
            self.by_user[kind, user_id] += 1
            self.by_kind[kind] += 1
        return None

    def give_back(self, kind: str, user_id) -> None:
        with self.lock:
            self.by_user[kind, user_id] -= 1
            self.by_kind[kind] -= 1
            if self.by_user[kind, user_id] <= 0:
                del self.by_user[kind, user_id]

    @contextmanager
    def held(self, kind: str, user_id):
        """A slot for the block; Busy (429, Retry-After) when there is none."""
        if (refusal := self.take(kind, user_id)) is not None:
            raise Busy(f"{refusal}; retry after {RETRY_AFTER_SECONDS}s (see Retry-After), or follow over the websocket")
        try:
            yield
        finally:
            self.give_back(kind, user_id)

    def hold_while(self, kind: str, user_id, chunks):
        """A slot for as long as the iterator `chunks` is read (a streamed response); Busy when none."""
        if (refusal := self.take(kind, user_id)) is not None:
            raise Busy(f"{refusal}; retry after {RETRY_AFTER_SECONDS}s (see Retry-After)")
        return _Held(chunks, lambda: self.give_back(kind, user_id))


def describe(kind: str) -> str:
    return {"long_poll": "long polls", "stream": "downloads and log streams"}[kind]


class _Held:
    """A streamed response's content that gives its slot back when closed (Django closes a
    response's content when the response ends, read to the end or not)."""

    def __init__(self, chunks, release):
        self.chunks, self.release = chunks, release

    def __iter__(self):
        yield from self.chunks

    async def __aiter__(self):
        async for chunk in self.chunks:
            yield chunk

    def close(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


slots = Slots()
