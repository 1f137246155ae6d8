"""A request id for every request: in the X-Request-Id response header, in every 5xx
error body, and in the server log line each 5xx writes (with the traceback of a crash),
so "the server log has the details" can be followed from an error to its cause."""

import json
import logging
import re
import uuid

log = logging.getLogger("hangar.web")
HEADER = "X-Request-Id"
# An id a proxy in front already gave the request is kept when it looks like one.
INCOMING = re.compile(r"^[A-Za-z0-9._-]{8,64}$")


def request_id_of(request) -> str:
    return getattr(request, "request_id", "") or "-"


class RequestIdMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        incoming = request.META.get("HTTP_X_REQUEST_ID", "")
        request.request_id = incoming if INCOMING.match(incoming) else uuid.uuid4().hex
        response = self.get_response(request)
        response[HEADER] = request.request_id
        if response.status_code >= 500:
            log.error(
                "%s %s answered %s (request id %s)",
                request.method,
                request.path,
                response.status_code,
                request.request_id,
            )
            carry_request_id(response, request.request_id)
        return response


def carry_request_id(response, request_id: str) -> None:
    """Put `request_id` into a JSON error body of the API's shape."""
    if getattr(response, "streaming", False) or not response.get("Content-Type", "").startswith("application/json"):
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        return
    if isinstance(body, dict) and "code" in body and "errors" in body:
        body["request_id"] = request_id
        body["message"] = f"{body['message']} (request id {request_id})"
        response.content = json.dumps(body)
        if response.has_header("Content-Length"):  # set by CommonMiddleware for the old body
            response["Content-Length"] = str(len(response.content))
