"""The Redis client's failure mapping and URL forms (pure logic; the real-server checks are
in tests/integration/test_redis_sentinel.py and the outage tests)."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from runtime.redis import REDIS_DOWN, Client, parse_sentinel_url, redis_client


async def test_a_runtime_error_in_the_client_is_redis_down(monkeypatch):
    async def broken(self, *args, **options):
        raise RuntimeError("read() called while another coroutine is already waiting for incoming data")

    monkeypatch.setattr(Redis, "execute_command", broken)
    client = redis_client("redis://127.0.0.1:1/0")
    assert isinstance(client, Client)
    with pytest.raises(REDIS_DOWN):
        await client.get("arena:x")


def test_sentinel_urls():
    assert parse_sentinel_url("redis+sentinel://127.0.0.1:26379/arena") == ([("127.0.0.1", 26379)], "arena", 0, None)
    assert parse_sentinel_url("redis+sentinel://:s%40cret@a:1,b:2/arena/3") == (
        [("a", 1), ("b", 2)],
        "arena",
        3,
        "s@cret",
    )
    for bad in ("redis+sentinel://a/arena", "redis+sentinel://a:1/", "redis+sentinel://a:1/arena/x"):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)
