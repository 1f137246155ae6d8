"""The API's one error shape, as data (portal/api/errors.py answers with it):

{"code": "invalid", "message": "command: ...", "errors": [{"field": "command", "message": "..."}]}
"""


def flatten(detail, path: str = "") -> list[dict]:
    """DRF's nested error detail as a flat list of {field, message}."""
    if isinstance(detail, dict):
        out = []
        for key, value in detail.items():
            if key == "non_field_errors":
                field = path
            elif isinstance(key, int):  # a list's errors by index
                field = f"{path}[{key}]"
            else:
                field = f"{path}.{key}" if path else str(key)
            out.extend(flatten(value, field))
        return out
    if isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            return [{"field": path, "message": str(item)} for item in detail]
        out = []
        for index, item in enumerate(detail):
            out.extend(flatten(item, f"{path}[{index}]"))
        return out
    return [{"field": path, "message": str(detail)}]


def error_body(code: str, errors: list[dict]) -> dict:
    first = errors[0] if errors else {"field": "", "message": "request failed"}
    message = f"{first['field']}: {first['message']}" if first["field"] else first["message"]
    return {"code": code, "message": message, "errors": errors}
