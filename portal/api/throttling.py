"""Rate limits per API token, with Retry-After on the 429.

With Redis (REDIS_URL) the count is shared by every web worker: a fixed window per token
in Redis, one round trip per request. Without it each process counts in its own memory,
so with several workers a token may make up to (workers x limit) requests."""

import logging

import redis
from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle

from portal.models import ApiToken
from portal.redisclients import redis_client

log = logging.getLogger("hangar.api")


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

    def allow_request(self, request, view) -> bool:
        if not settings.REDIS_URL or self.rate is None:
            return super().allow_request(request, view)
        return self.allow_shared(self.get_cache_key(request, view))

    def allow_shared(self, key: str) -> bool:
        """Count this request in Redis; a window may let through up to twice the rate at its edge."""
        now = self.timer()
        window = int(now // self.duration)
        name = f"{settings.REDIS_PREFIX}:{key}:{window}"
        try:
            count, _ = (
                redis_client(settings.REDIS_URL)
                .pipeline(transaction=False)
                .incr(name)
                .expire(name, self.duration + 1)
                .execute()
            )
        except redis.RedisError as exc:
            log.warning("rate limit not checked (Redis: %s); request allowed", exc)  # serve rather than refuse
            return True
        if count <= self.num_requests:
            return True
        self.wait_seconds = (window + 1) * self.duration - now
        return False

    def wait(self) -> float | None:
        if hasattr(self, "wait_seconds"):
            return self.wait_seconds
        return super().wait()
