"""The Redis client every process uses: a bounded, blocking pool and retries with backoff.

A burst of waiting requests must queue for a connection rather than fail
(redis-py's default pool raises MaxConnectionsError), and a short outage is retried
before an error reaches a caller.
"""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: What callers catch when Redis is unreachable (after the client's own retries).
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)


def redis_client(url: str, max_connections: int = 64, wait_s: float = 5.0, retries: int = 3) -> Redis:
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=wait_s,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        retry_on_timeout=True,
        health_check_interval=10,
    )
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), retries)
    return Redis(connection_pool=pool, retry=retry, retry_on_error=[RedisConnectionError, RedisTimeoutError])
