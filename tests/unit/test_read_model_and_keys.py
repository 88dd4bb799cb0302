"""The Redis read model and the gateway's keys, on fakeredis (the layouts are contracts)."""

from __future__ import annotations

import fakeredis

from events.readmodel import ReadModel
from gateway.keys import GatewayKeys


async def test_first_result_wins():
    store = ReadModel(fakeredis.FakeAsyncRedis(), ttl_s=60)
    assert await store.save_result("r", b"first")
    assert not await store.save_result("r", b"second")
    assert await store.get_result("r") == b"first"
    assert await store.redis.ttl("arena:result:r") > 0


async def test_pending_index_keeps_the_first_record():
    store = ReadModel(fakeredis.FakeAsyncRedis())
    assert await store.pending("r") is None
    await store.record_pending("r", "c", 2, "m", 10.0)
    await store.record_pending("r", "other", 3, "m", 20.0)
    assert await store.pending("r") == {"conv_id": "c", "turn_id": 2, "model": "m", "deadline_at": 10.0}


async def test_idempotency_claims_release_and_seeds():
    keys = GatewayKeys(fakeredis.FakeAsyncRedis())
    assert await keys.claim_key("k", "r1", "h") == {"request_id": "r1", "body_hash": "h"}
    assert (await keys.claim_key("k", "r2", "h"))["request_id"] == "r1"
    await keys.release_key("k", "r2")  # not the holder: nothing happens
    assert (await keys.claim_key("k", "r3", "h"))["request_id"] == "r1"
    await keys.release_key("k", "r1")
    assert (await keys.claim_key("k", "r4", "h"))["request_id"] == "r4"
    assert await keys.seed_for("c", 0, 7) == 7
    assert await keys.seed_for("c", 0, 9) == 7
    await keys.hold("r", "socket-1")
    assert await keys.holder("r") == "socket-1"
