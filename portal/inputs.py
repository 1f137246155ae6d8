"""What every request's input must be before a view sees it, checked once for all fields.

Text no database column holds (a NUL character: PostgreSQL refuses it; a lone surrogate:
not Unicode, no driver encodes it), numbers no column holds (past 64 bits, infinite, NaN)
and JSON nested deeper than any Hangar request (100,000 levels overflowed the parser's
stack) used to reach the ORM and end as 500s. Here they are a 400 naming the field:
- query parameters and the path: InputMiddleware;
- JSON bodies: JSONParser (the API's only parser);
- numbers in query parameters: whole_number / real_number, used by the parameter helpers.
"""

import math

from django.http import HttpResponse, JsonResponse
from rest_framework import parsers, serializers

MAX_DEPTH = 32
INT64_MAX = 2**63 - 1


class InputError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_text(value: str, field: str) -> None:
    if "\x00" in value:
        raise InputError(field, "contains a NUL character (\\u0000), which no field accepts; remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(field, "contains a lone surrogate (e.g. \\ud800), which is not valid Unicode text; remove it")


def check_number(value: int | float, field: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(field, f"is {value}; send a finite number")
    if abs(value) > INT64_MAX:
        raise InputError(field, f"is out of range; use a number between {-INT64_MAX} and {INT64_MAX}")


def check_tree(data, max_depth: int = MAX_DEPTH) -> None:
    """Every string, key and number of parsed JSON, iteratively (no recursion to overflow)."""
    stack = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > max_depth:
            raise InputError(path or "body", f"nests deeper than {max_depth} levels; send a flatter object")
        if isinstance(value, dict):
            for key, item in value.items():
                check_text(key, f"{path}.{key!r}" if path else "body")
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{index}]", depth + 1) for index, item in enumerate(value))
        elif isinstance(value, str):
            check_text(value, path or "body")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            check_number(value, path or "body")


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, and then check_tree: a bad value is a 400 naming its field."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise serializers.ValidationError({"body": f"nests deeper than {MAX_DEPTH} levels; send a flatter object"})
        try:
            check_tree(data)
        except InputError as exc:
            raise serializers.ValidationError({exc.field: exc.message})
        return data


def whole_number(raw: str, field: str, maximum: int = INT64_MAX) -> int:
    """A query parameter that must be a whole number from 0 to `maximum`; InputError otherwise."""
    try:
        value = int(raw)
    except ValueError:
        raise InputError(field, f"must be a whole number, got {raw!r}")
    if value < 0:
        raise InputError(field, "must not be negative")
    if value > maximum:
        raise InputError(field, f"must be at most {maximum}")
    return value


def real_number(raw: str, field: str, maximum: float) -> float:
    """A query parameter that must be a finite number from 0 to `maximum`; InputError otherwise."""
    try:
        value = float(raw)
    except ValueError:
        raise InputError(field, f"must be a number, got {raw!r}")
    if not math.isfinite(value):
        raise InputError(field, f"is {value}; send a finite number")
    if value < 0:
        raise InputError(field, "must not be negative")
    if value > maximum:
        raise InputError(field, f"must be at most {maximum:g}")
    return value


class InputMiddleware:
    """Query parameters (names and values) and the path hold no NUL and no lone surrogate."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        try:
            check_text(request.path, "path")
            for name, values in request.GET.lists():
                check_text(name, "query")
                for value in values:
                    check_text(value, name)
        except InputError as exc:
            return refused(request, exc)
        return self.get_response(request)


def refused(request, exc: InputError) -> HttpResponse:
    from portal.api.errors import error_body

    if request.path.startswith("/api/"):
        return JsonResponse(error_body("invalid", [{"field": exc.field, "message": exc.message}]), status=400)
    return HttpResponse(str(exc), status=400, content_type="text/plain; charset=utf-8")
