"""Rate limits per API token, with Retry-After on the 429."""

from rest_framework.throttling import SimpleRateThrottle

from portal.models import ApiToken


class TokenRateThrottle(SimpleRateThrottle):
    scope = "token"

    def get_cache_key(self, request, view) -> str:
        if isinstance(request.auth, ApiToken):
            ident = f"token-{request.auth.pk}"
        elif request.user is not None and request.user.is_authenticated:
            ident = f"user-{request.user.pk}"
        else:
            ident = f"addr-{self.get_ident(request)}"
        return self.cache_format % {"scope": self.scope, "ident": ident}
