"""What drf-spectacular needs to describe Hangar's own pieces in the OpenAPI schema."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "portal.auth.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token (`hgr_...`) from the API tokens page, `POST /api/v1/tokens/` "
            "or `manage.py create_token`.",
        }


def or_empty(schema: dict) -> dict:
    """A query parameter's schema that also admits the empty value, which the API reads as absent."""
    return {"anyOf": [schema, {"type": "string", "maxLength": 0}]}


# Every status the API may answer besides an operation's own success: the error shape
# (portal/api/errors.py) from authentication, permissions, validation, lookups, limits
# (portal/bodylimits.py, portal/capacity.py, throttling) and outages.
ERROR_STATUSES = {
    "400": "Invalid request: `errors` names each field and the fix",
    "401": "No valid credentials",
    "403": "Not allowed (a read-only or project-limited token, or a role too low)",
    "404": "Not found, or not in a project you belong to",
    "405": "Method not allowed",
    "406": "The Accept header asks for something other than JSON",
    "409": "Conflicts with an existing record",
    "413": "Request body over its size limit",
    "415": "Body is not JSON",
    "429": "Rate limit or a bound on long polls and streams: see Retry-After",
    "500": "Internal error: `request_id` is in the server log",
    "503": "Database briefly unavailable: see Retry-After",
}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["code", "message", "errors"],
    "properties": {
        "code": {"type": "string"},
        "message": {"type": "string"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["field", "message"],
                "properties": {"field": {"type": "string"}, "message": {"type": "string"}},
            },
        },
        "request_id": {"type": "string", "description": "on 5xx: the id the server log has it under"},
    },
}


def declare_errors(result: dict, generator, request, public) -> dict:
    """drf-spectacular postprocessing hook: the error responses, on every operation."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    reference = {"$ref": "#/components/schemas/Error"}
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            if method not in ("get", "put", "post", "patch", "delete", "head", "options"):
                continue
            responses = operation.setdefault("responses", {})
            for status, description in ERROR_STATUSES.items():
                responses.setdefault(
                    status, {"description": description, "content": {"application/json": {"schema": reference}}}
                )
    for schema in result["components"]["schemas"].values():
        no_nul_in_strings(schema)
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            for parameter in operation.get("parameters", []) if isinstance(operation, dict) else []:
                no_nul_in_strings(parameter.get("schema", {}))
    return result


NO_NUL = "^[^\\x00]*$"


def no_nul_in_strings(schema) -> None:
    """Free-text strings say what the API refuses in them: a NUL character (portal.inputs)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") == "string" and not ({"enum", "format", "pattern"} & node.keys()):
            node["pattern"] = NO_NUL
        stack.extend(value for key, value in node.items() if isinstance(value, dict | list) and key != "enum")
