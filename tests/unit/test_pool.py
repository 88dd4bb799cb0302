"""Tests of the LRU model pool with copies of the real stories260K model."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from consumers.inference.errors import PermanentError, PoolExhausted, RetryableError, UnknownModel
from consumers.inference.model_loading import LoadedModel, ModelSpec, load_model
from consumers.inference.pool import ModelPool

pytestmark = pytest.mark.integration  # runs the real stories260K model in-process

STORIES = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K-hf"
NAMES = ["a", "b", "c"]


class CountingLoader:
    """Wraps load_model, counting calls per name; optionally slow, to widen races."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: dict[str, int] = {}
        self.delay = delay
        self.threads: set[int] = set()

    def __call__(self, spec: ModelSpec, version: int) -> LoadedModel:
        self.calls[spec.name] = self.calls.get(spec.name, 0) + 1
        self.threads.add(threading.get_ident())
        if self.delay:
            import time

            time.sleep(self.delay)
        return load_model(spec, version)


@pytest.fixture(scope="module")
def one_model_bytes() -> int:
    return load_model(ModelSpec(name="x", path=str(STORIES))).nbytes


def make_pool(one_model_bytes: int, loader=None, **kwargs) -> ModelPool:
    specs = [ModelSpec(name=n, path=str(STORIES)) for n in NAMES]
    return ModelPool(specs, budget_bytes=int(2.5 * one_model_bytes), loader=loader or CountingLoader(), **kwargs)


async def test_hit_miss_and_lru_eviction(one_model_bytes):
    loader = CountingLoader()
    pool = make_pool(one_model_bytes, loader)
    async with pool.use("a") as a:
        assert a.spec.name == "a" and a.version == 1
    async with pool.use("b"):
        pass
    async with pool.use("a"):  # a becomes most recent
        pass
    assert pool.resident() == ["b", "a"]
    async with pool.use("c"):  # evicts b, the least recently used
        pass
    assert pool.resident() == ["a", "c"]
    stats = pool.stats
    assert (stats.hits, stats.misses, stats.loads, stats.evictions) == (1, 3, 3, 1)
    assert stats.resident_bytes == 2 * one_model_bytes <= pool.budget_bytes
    assert stats.load_seconds > 0
    assert loader.calls == {"a": 1, "b": 1, "c": 1}


async def test_pinned_model_is_never_evicted(one_model_bytes):
    pool = make_pool(one_model_bytes)
    async with pool.use("a"):
        async with pool.use("b"):
            pass
        async with pool.use("c"):  # a is older than b but pinned: b goes
            pass
        assert pool.resident() == ["a", "c"]


async def test_exhausted_when_everything_is_pinned(one_model_bytes):
    pool = make_pool(one_model_bytes, wait_timeout=0.2)
    async with pool.use("a"), pool.use("b"):
        with pytest.raises(PoolExhausted) as err:
            await pool.acquire("c")
        assert isinstance(err.value, RetryableError)
    assert sorted(pool.resident()) == ["a", "b"]


async def test_waiting_load_proceeds_after_release(one_model_bytes):
    pool = make_pool(one_model_bytes, wait_timeout=10)
    a = await pool.acquire("a")
    b = await pool.acquire("b")
    waiter = asyncio.create_task(pool.acquire("c"))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    pool.release(a)
    c = await asyncio.wait_for(waiter, 5)
    assert c.spec.name == "c" and sorted(pool.resident()) == ["b", "c"]
    pool.release(b)
    pool.release(c)


async def test_single_flight_load_off_the_event_loop(one_model_bytes):
    loader = CountingLoader(delay=0.3)
    pool = make_pool(one_model_bytes, loader)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    results = await asyncio.gather(*(pool.acquire("a") for _ in range(10)))
    tick_task.cancel()
    assert loader.calls == {"a": 1}
    assert all(r is results[0] for r in results)
    assert threading.get_ident() not in loader.threads
    assert ticks >= 10  # the loop kept running during the 0.3 s load
    assert (pool.stats.loads, pool.stats.misses) == (1, 10)
    for r in results:
        pool.release(r)


async def test_concurrent_cold_loads_of_different_models(one_model_bytes):
    loader = CountingLoader(delay=0.05)
    pool = make_pool(one_model_bytes, loader, wait_timeout=10)

    async def borrow(name):
        async with pool.use(name) as m:
            await asyncio.sleep(0.01)
            return m.spec.name

    names = await asyncio.gather(*(borrow(n) for n in NAMES * 3))
    assert names == NAMES * 3
    assert len(pool.resident()) <= 2
    assert pool.stats.resident_bytes <= pool.budget_bytes


async def test_unknown_model_is_permanent(one_model_bytes):
    pool = make_pool(one_model_bytes)
    with pytest.raises(UnknownModel) as err:
        await pool.acquire("nope")
    assert isinstance(err.value, PermanentError) and "a, b, c" in str(err.value)


async def test_load_failure_reaches_every_waiter_and_is_not_cached(tmp_path, one_model_bytes):
    pool = ModelPool([ModelSpec(name="broken", path=str(tmp_path))], budget_bytes=one_model_bytes)
    results = await asyncio.gather(*(pool.acquire("broken") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, PermanentError) for r in results)
    assert pool.resident() == [] and pool.stats.loads == 1


async def test_reload_swaps_version_and_old_users_keep_theirs(one_model_bytes):
    loader = CountingLoader()
    pool = make_pool(one_model_bytes, loader)
    async with pool.use("a") as old:
        new = await pool.reload("a")
        assert (old.version, new.version) == (1, 2)
        assert old.model is not new.model
        async with pool.use("a") as current:
            assert current is new
        # the old version still counts against the budget while borrowed
        assert pool.stats.resident_bytes == 2 * one_model_bytes
    assert pool.stats.resident_bytes == one_model_bytes
    assert loader.calls == {"a": 2}


async def test_add_and_remove(one_model_bytes):
    pool = make_pool(one_model_bytes)
    await pool.add(ModelSpec(name="d", path=str(STORIES)))
    async with pool.use("d") as d:
        assert d.spec.name == "d"
        await pool.remove("d")
        assert "d" not in pool.resident()
        assert pool.stats.resident_bytes == one_model_bytes  # still borrowed
    assert pool.stats.resident_bytes == 0
    with pytest.raises(UnknownModel):
        await pool.acquire("d")
    with pytest.raises(ValueError):
        await pool.add(ModelSpec(name="a", path=str(STORIES)))


async def test_a_base_with_variants_is_not_removed(one_model_bytes):
    """Removing a base would leave its variants naming weights that are gone (and /readyz
    false when one is the default): refused, naming them, until they are removed."""
    pool = make_pool(one_model_bytes)
    await pool.add(ModelSpec(name="v2", path=str(STORIES), base="a"))
    await pool.add(ModelSpec(name="v1", path=str(STORIES), base="a"))
    with pytest.raises(ValueError, match="model 'a' is the base of v1, v2, which would stop working: remove them"):
        await pool.remove("a")
    assert {"a", "v1", "v2"} <= {s.name for s in pool.specs()}
    await pool.remove("v1")
    await pool.remove("v2")
    await pool.remove("a")
    assert "a" not in {s.name for s in pool.specs()}


async def test_context_lengths_from_the_config_then_as_loaded(one_model_bytes, tmp_path):
    """What the heartbeats tell the gateway: known before a load (the checkpoint's config),
    a variant's its base's, a model whose config cannot be read left out until loaded."""
    pool = make_pool(one_model_bytes)
    await pool.add(ModelSpec(name="v", path=str(STORIES), base="a"))
    await pool.add(ModelSpec(name="missing", path=str(tmp_path / "none")))
    assert pool.contexts() == {"a": 512, "b": 512, "c": 512, "v": 512}
    async with pool.use("a") as a:
        assert a.context_len == 512
    await pool.remove("b")
    assert sorted(pool.contexts()) == ["a", "c", "v"]


async def test_warm_loads_in_order(one_model_bytes):
    pool = make_pool(one_model_bytes)
    await pool.warm(["c", "a"])
    assert pool.resident() == ["c", "a"]
    assert pool.stats.loads == 2


async def test_model_larger_than_budget_is_permanent(one_model_bytes):
    pool = make_pool(one_model_bytes)
    await pool.warm(["a"])  # its size is now known exactly
    pool.budget_bytes = one_model_bytes // 2
    with pytest.raises(PermanentError, match="raise the budget"):
        await pool.reload("a")
    async with pool.use("a") as a:  # the resident version is untouched
        assert a.version == 1


def test_release_of_unborrowed_model_is_an_error(one_model_bytes):
    pool = make_pool(one_model_bytes)
    with pytest.raises(RuntimeError):
        pool.release(load_model(ModelSpec(name="a", path=str(STORIES))))
