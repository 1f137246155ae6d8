"""The API's limit/offset pages, with their parameters checked like every other number."""

from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination

from portal.inputs import InputError, whole_number

MAX_PAGE = 1000
MAX_OFFSET = 10**12


class Pagination(LimitOffsetPagination):
    """`limit` (1 to 1000; more is read as 1000) and `offset`; anything else is a 400 naming it."""

    max_limit = MAX_PAGE

    def get_limit(self, request) -> int:
        raw = request.query_params.get(self.limit_query_param)
        if raw in (None, ""):
            return self.default_limit
        value = checked(raw, self.limit_query_param, 2**63 - 1)
        if value < 1:
            raise serializers.ValidationError({self.limit_query_param: "must be at least 1"})
        return min(value, self.max_limit)

    def get_offset(self, request) -> int:
        raw = request.query_params.get(self.offset_query_param)
        return 0 if raw in (None, "") else checked(raw, self.offset_query_param, MAX_OFFSET)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"] = LIMIT_SCHEMA if parameter["name"] == self.limit_query_param else OFFSET_SCHEMA
        return parameters


def checked(raw: str, field: str, maximum: int) -> int:
    try:
        return whole_number(raw, field, maximum)
    except InputError as exc:
        raise serializers.ValidationError({exc.field: exc.message})


LIMIT_SCHEMA = {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}
OFFSET_SCHEMA = {"type": "integer", "minimum": 0, "maximum": MAX_OFFSET}
