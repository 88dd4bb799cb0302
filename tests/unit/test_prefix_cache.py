"""The prefix cache's pure logic: lookups by token prefix, extension, the byte budget,
and the counts the worker's metrics are made from."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from consumers.inference.engine.prefix import PrefixCache, PrefixStats, block_hashes, common_prefix
from consumers.inference.metrics import PrefixCounts

B = 4  # a small block keeps the sequences short


def seq(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_block_hashes_chain_every_token_before_them():
    a, b = seq(12), seq(12)
    b[1] = 0  # a change in the first block changes every later hash
    assert len(block_hashes(a, B)) == 3 and len(block_hashes(seq(11), B)) == 2
    assert all(x != y for x, y in zip(block_hashes(a, B), block_hashes(b, B), strict=True))
    assert block_hashes(a, B)[:2] == block_hashes(a[:9], B)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_a_next_turn_reuses_the_previous_sequence_and_leaves_one_token_to_compute():
    cache = PrefixCache(1000, block=B)
    turn1 = seq(10)
    assert cache.lookup(turn1) is None
    assert cache.store(turn1, "kv1", 10)
    hit = cache.lookup([*turn1, 7, 8, 9])  # the history, then the new turn
    assert hit is not None and (hit.tokens, hit.value) == (10, "kv1")
    exact = cache.lookup(turn1)  # the same prompt again: its last token is computed
    assert exact is not None and exact.tokens == 9
    assert cache.stats == PrefixStats(hits=2, misses=1, reused_tokens=19, evictions=0, entries=1, bytes=10)


def test_a_prompt_that_parts_midway_reuses_up_to_where_it_parts():
    cache = PrefixCache(1000, block=B)
    cache.store(seq(20), "kv", 10)
    parted = seq(20)
    parted[13] = 0  # re-tokenized history: the tokens part after 13
    hit = cache.lookup(parted)
    assert hit is not None and hit.tokens == 13


def test_less_than_a_block_in_common_is_a_miss():
    cache = PrefixCache(1000, block=B)
    cache.store(seq(10), "kv", 10)
    assert cache.lookup([*seq(3), 0, 0, 0]) is None
    assert cache.lookup(seq(3)) is None  # shorter than a block: never found
    assert not cache.store(seq(3), "short", 1)


def test_of_two_sequences_sharing_a_start_the_longer_match_wins():
    cache = PrefixCache(1000, block=B)
    a = [*seq(8), 1, 1, 1, 1, 1, 1]
    b = [*seq(8), 1, 1, 2, 2, 2, 2]
    cache.store(a, "a", 1)
    cache.store(b, "b", 1)
    hit = cache.lookup([*seq(8), 1, 1, 2, 2, 9])
    assert hit is not None and (hit.value, hit.tokens) == ("b", 12)
    hit = cache.lookup([*seq(8), 1, 1, 1, 1, 1, 1, 5])
    assert hit is not None and (hit.value, hit.tokens) == ("a", 14)


def test_a_longer_turn_replaces_the_one_it_extends():
    cache = PrefixCache(1000, block=B)
    cache.store(seq(8), "turn1", 8)
    cache.store(seq(16), "turn2", 16)  # turn 1's tokens and more: turn 1's entry goes
    assert cache.stats.entries == 1 and cache.stats.bytes == 16 and cache.stats.evictions == 0
    assert cache.store(seq(12), "inside", 12)  # held already, inside turn 2's
    assert cache.stats.entries == 1
    hit = cache.lookup([*seq(8), 0])
    assert hit is not None and hit.value == "turn2"


def test_least_recently_used_sequences_leave_past_the_budget():
    cache = PrefixCache(30, block=B)
    cache.store(seq(8, 0), "a", 10)
    cache.store(seq(8, 100), "b", 10)
    cache.store(seq(8, 200), "c", 10)
    assert cache.lookup([*seq(8, 0), 1]) is not None  # a is used: b is now the oldest
    cache.store(seq(8, 300), "d", 10)
    assert cache.lookup([*seq(8, 100), 1]) is None
    assert {v for v in "acd" if cache.lookup([*seq(8, 100 * "abcd".index(v)), 1]) is not None} == set("acd")
    assert cache.stats.evictions == 1 and cache.stats.bytes == 30
    assert not cache.store(seq(8, 400), "huge", 31)  # over the budget alone: not kept, nothing evicted
    assert cache.stats.entries == 3


def test_clear_empties_it():
    cache = PrefixCache(100, block=B)
    cache.store(seq(8), "a", 10)
    cache.clear()
    assert cache.lookup([*seq(8), 1]) is None and cache.stats.bytes == 0 and cache.stats.entries == 0


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1)


def value(name: str, model: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": model}) or 0.0


def test_counts_grow_by_what_an_engine_added_and_start_over_with_a_new_engine():
    counts = PrefixCounts("prefix-unit")
    counts.update(PrefixStats(hits=2, misses=1, reused_tokens=50, evictions=0, entries=1, bytes=640))
    counts.update(PrefixStats(hits=3, misses=1, reused_tokens=90, evictions=1, entries=1, bytes=700))
    counts.update(None)  # a state without the cache (an engine process that died): nothing
    counts.update(PrefixStats(hits=1, misses=0, reused_tokens=20, evictions=0, entries=1, bytes=100))  # restarted
    assert value("arena_prefix_cache_hits_total", "prefix-unit") == 4
    assert value("arena_prefix_cache_misses_total", "prefix-unit") == 1
    assert value("arena_prefix_cache_reused_tokens_total", "prefix-unit") == 110
    assert value("arena_prefix_cache_evictions_total", "prefix-unit") == 1
    assert value("arena_prefix_cache_bytes", "prefix-unit") == 100
