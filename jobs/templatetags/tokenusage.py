"""The tokens page's limits column (templates/portal/tokens.html): portal's page cannot import
jobs (the floors), so it loads this tag, which reads the usage from jobs/tokenlimits.py."""

from django import template

from jobs import tokenlimits

register = template.Library()


@register.inclusion_tag("portal/partials/token_limits.html")
def token_limits(token):
    limited = any(value is not None for value in token.limits.values())
    used = tokenlimits.usage(token).as_dict() if limited and token.revoked_at is None else None
    return {"token": token, "limited": limited, "used": used}
