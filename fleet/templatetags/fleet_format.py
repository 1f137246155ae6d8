"""How the fleet pages show readings and evidence."""

from django import template

register = template.Library()


@register.filter
def reading(value, unit: str = "") -> str:
    """A reading with its unit, `–` when there is none: 0 % is a reading (`default` would hide it)."""
    if value is None or value == "":
        return "–"
    return f"{float(value):.0f}{unit}"


@register.inclusion_tag("fleet/partials/evidence.html")
def evidence(data) -> dict:
    """Evidence (a JSON object) as a small key/value table; nested objects as dotted keys."""
    return {"rows": flat_items(data) if isinstance(data, dict) else [("", data)] if data else []}


def flat_items(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows = []
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows.extend(flat_items(value, name + "."))
        elif isinstance(value, list):
            rows.append((name, ", ".join(str(v) for v in value)))
        else:
            rows.append((name, value))
    return rows
