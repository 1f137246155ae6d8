"""One synchronous Redis client per URL, for the process's short commands beside the channel
layer and the broker (the API's shared rate limits, the agent's look at a log's viewers). A
leaf: it imports no app. A Redis that does not answer fails a command within a second."""

import functools

import redis


@functools.cache
def redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
