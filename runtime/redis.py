"""The Redis client every process uses: a bounded, blocking pool and retries with backoff.

A burst of waiting requests must queue for a connection rather than fail
(redis-py's default pool raises MaxConnectionsError), and a short outage is retried
before an error reaches a caller.

URLs: `redis://` and `rediss://` (TLS) as redis-py reads them, and
`redis+sentinel://[:password@]host:port[,host:port...]/service[/db]` for a master found
through Redis Sentinel: after a failover the pool reconnects to the new master.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

#: What callers catch when Redis is unreachable (after the client's own retries).
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)

SENTINEL_SCHEME = "redis+sentinel"


class Client(Redis):
    """redis-py's client, with one more way Redis can be unreachable: under load its
    asyncio read path can raise RuntimeError (redis/redis-py#3748, and concurrent reads
    of one connection after a cancellation); that is a failed call, answered like any
    other (REDIS_DOWN: a 503 and a retry), not a 500."""

    async def execute_command(self, *args, **options):
        try:
            return await super().execute_command(*args, **options)
        except RuntimeError as exc:
            raise RedisConnectionError(f"the Redis client failed: {exc}") from exc


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's master discovery with the blocking pool's queueing for a connection."""


def redis_client(url: str, max_connections: int = 64, wait_s: float = 5.0, retries: int = 3) -> Redis:
    options: dict[str, Any] = dict(
        max_connections=max_connections,
        timeout=wait_s,
        socket_connect_timeout=1.0,
        socket_timeout=2.0,
        retry_on_timeout=True,
        health_check_interval=10,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    if url.startswith(f"{SENTINEL_SCHEME}://"):
        sentinels, service, db, password = parse_sentinel_url(url)
        sentinel = Sentinel(sentinels, socket_connect_timeout=1.0, socket_timeout=2.0)
        return sentinel.master_for(
            service, redis_class=Client, connection_pool_class=BlockingSentinelPool, db=db, password=password, **options
        )
    retry, retry_on_error = options.pop("retry"), options.pop("retry_on_error")
    pool = BlockingConnectionPool.from_url(url, **options)
    return Client(connection_pool=pool, retry=retry, retry_on_error=retry_on_error)


def masked(url: str) -> str:
    """The URL with its password (if any) as `***`, for messages and logs."""
    return re.sub(r"(?<=://)([^/@]*?):[^/@]*@", r"\1:***@", url)


def parse_sentinel_url(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """`redis+sentinel://[:password@]h1:p1,h2:p2/service[/db]` -> sentinels, service, db,
    the master's password."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"{SENTINEL_SCHEME} URL: '{host}' is not host:port")
        sentinels.append((name, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{SENTINEL_SCHEME} URL needs /service or /service/db, got '{parts.path}'")
    password = unquote(auth.partition(":")[2]) if auth else None
    return sentinels, path[0], int(path[1]) if len(path) == 2 else 0, password or None
