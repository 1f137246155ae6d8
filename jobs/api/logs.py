"""The log API: filtered, cursor-paged lines (with a long-poll follow mode) and streamed downloads.

    GET /api/v1/jobs/<id>/logs/?after_attempt=&after_seq=&limit=&follow=&wait=&<filters>
    GET /api/v1/jobs/<id>/logs/download/?as=text|jsonl&<filters>

Filters (jobs/logquery.py): attempt, node, rank, severity, since, until,
last_minutes, q, regex.
"""

import json
import time
from contextlib import ExitStack

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import StreamingHttpResponse
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import AuthenticationFailed, NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.api.views import int_param
from jobs.logquery import MAX_MINUTES, SEVERITY_NAMES, LogFilter, LogFilterError, read_page, wire_lines
from jobs.models import FINAL_JOB_STATES, Job
from portal import wsauth
from portal.api.schema import or_empty
from portal.capacity import slots
from portal.models import ApiToken
from portal.patterns import MAX_PATTERN_CHARS

LOG_PAGE_MAX = 5000
FOLLOW_WAIT_MAX = 25.0
FOLLOW_POLL_SECONDS = 0.2
DOWNLOAD_CHUNK = 5000


def visible_job(request, pk: int) -> Job:
    return get_object_or_404(Job.objects.visible_to(request.user), pk=pk)


def job_state(request, job_id: int, waited: bool) -> str:
    """The job's state. After a wait, read with whether the caller still may: a revoked token, a
    deactivated user, a logout or a project left ends a long poll at its next look (every
    FOLLOW_POLL_SECONDS), in the same query, not at the end of its wait."""
    if not waited:
        return Job.objects.filter(pk=job_id).values_list("state", flat=True).get()
    session = getattr(getattr(request, "session", None), "session_key", None)
    token_id = request.auth.pk if isinstance(request.auth, ApiToken) else None
    conditions = wsauth.still_signed_in(request.user.pk, token_id, session)
    state = Job.objects.visible_to(request.user).filter(*conditions, pk=job_id).values_list("state", flat=True).first()
    if state is not None:
        return state
    if Job.objects.filter(*conditions, pk=job_id).exists():  # still signed in: out of the job's project
        raise NotFound(f"no job {job_id} in your projects; you may no longer see it")
    raise AuthenticationFailed("API token is unknown or revoked, or your session ended; sign in again")


def parse_filter(request) -> LogFilter:
    try:
        return LogFilter.parse(request.query_params)
    except LogFilterError as exc:
        raise serializers.ValidationError({exc.field: exc.message})


WHOLE = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
SEVERITIES = {"type": "string", "enum": sorted(SEVERITY_NAMES)}
MINUTES = {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": MAX_MINUTES}
TIME = or_empty({"type": "string", "format": "date-time"})
FILTER_PARAMETERS = [
    OpenApiParameter(name, kind)
    for name, kind in (
        ("attempt", WHOLE), ("node", str), ("rank", WHOLE), ("severity", SEVERITIES),
        ("since", TIME), ("until", TIME), ("last_minutes", MINUTES),
        ("q", {"type": "string", "maxLength": MAX_PATTERN_CHARS}), ("regex", bool),
    )
]  # fmt: skip


class JobLogsView(APIView):
    """Matching lines after a cursor, and the cursor to pass next. With follow=1 the request
    waits up to `wait` seconds (default 20) for a line when none is there yet."""

    @extend_schema(
        parameters=[
            *FILTER_PARAMETERS,
            *(OpenApiParameter(n, WHOLE) for n in ("after_attempt", "after_seq", "limit", "wait")),
            OpenApiParameter("follow", bool),
        ],
        responses=OpenApiTypes.OBJECT,
    )
    def get(self, request, pk: int):
        job = visible_job(request, pk)
        log_filter = parse_filter(request)
        cursor = (int_param(request, "after_attempt", 0), int_param(request, "after_seq", 0))
        limit = max(1, min(int_param(request, "limit", 1000), LOG_PAGE_MAX))
        follow = request.query_params.get("follow", "").lower() in ("1", "true", "yes")
        wait = min(float(int_param(request, "wait", 20)), FOLLOW_WAIT_MAX) if follow else 0.0
        deadline = time.monotonic() + wait
        with ExitStack() as waiting:
            holding = False
            while True:
                # The state is read before the lines: a final state seen here means every line is stored.
                state = job_state(request, job.pk, waited=holding)
                lines, after, more = read_page(job.pk, log_filter, cursor, limit)
                final = state in FINAL_JOB_STATES and not more
                if lines or final or time.monotonic() >= deadline:
                    break
                cursor = after
                if not holding:
                    # Waiting holds a request thread: only within the user's and the process's bounds.
                    holding = waiting.enter_context(slots.held("long_poll", request.user.pk)) or True
                if not more:  # more with no lines: a walk through non-matching lines goes on at once
                    time.sleep(FOLLOW_POLL_SECONDS)
        return Response(
            {
                "lines": wire_lines(lines, log_filter.pattern()),
                "cursor": {"attempt": after[0], "seq": after[1]},
                "more": more,
                "job_state": state,
                "final": final,
                "filters": log_filter.as_dict(),
            }
        )


class JobLogDownloadView(APIView):
    """The whole (filtered) log as plain text or JSON lines, streamed in chunks read by cursor."""

    @extend_schema(
        parameters=[*FILTER_PARAMETERS, OpenApiParameter("as", str, enum=["text", "jsonl"])],
        responses={(200, "text/plain"): OpenApiTypes.STR, (200, "application/x-ndjson"): OpenApiTypes.STR},
    )
    def get(self, request, pk: int):
        job = visible_job(request, pk)
        log_filter = parse_filter(request)
        kind = request.query_params.get("as", "text")
        if kind not in ("text", "jsonl"):
            raise serializers.ValidationError({"as": f"{kind!r} is not a download format; use text or jsonl"})
        chunks = DownloadChunks(job.pk, log_filter, kind)
        # Under ASGI a synchronous iterator would be read whole before sending: stream asynchronously there.
        content = chunks.async_iter() if isinstance(request._request, ASGIRequest) else iter(chunks)
        content = slots.hold_while("stream", request.user.pk, content)  # 429 past the bounds (portal.capacity)
        response = StreamingHttpResponse(
            content, content_type="application/x-ndjson" if kind == "jsonl" else "text/plain; charset=utf-8"
        )
        suffix = "jsonl" if kind == "jsonl" else "log"
        response["Content-Disposition"] = f'attachment; filename="job-{job.pk}.{suffix}"'
        return response


class DownloadChunks:
    def __init__(self, job_id: int, log_filter: LogFilter, kind: str):
        self.job_id, self.log_filter, self.kind = job_id, log_filter, kind
        self.cursor = (0, 0)
        self.done = False

    def next_chunk(self) -> bytes | None:
        while not self.done:
            lines, self.cursor, more = read_page(self.job_id, self.log_filter, self.cursor, DOWNLOAD_CHUNK)
            self.done = not more
            if lines:
                wire = wire_lines(lines)
                if self.kind == "jsonl":
                    return "".join(json.dumps(line) + "\n" for line in wire).encode()
                return "".join(text_line(line) for line in wire).encode()
        return None

    def __iter__(self):
        while (chunk := self.next_chunk()) is not None:
            yield chunk

    async def async_iter(self):
        while (chunk := await sync_to_async(self.next_chunk)()) is not None:
            yield chunk


def text_line(line: dict) -> str:
    """One line of the plain-text download: time, node, rank, stream, severity, text."""
    return f"{line['ts']} {line['node'] or '-'} r{line['rank']} {line['stream']} {line['severity']} {line['text']}\n"
