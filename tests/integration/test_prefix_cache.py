"""The prefix cache on the real stories260K model: a conversation's turns, each prompt
rendering the history as the server does (encode_prompt over the messages so far, the
answer's text as the assistant message), answered by one engine that keeps the prefix
and by engines without it: the same tokens, greedy and seeded, alone and with other
requests running beside the turn (the packed pass too), and every turn after the first a
hit that reuses the history."""

from __future__ import annotations

import asyncio

import pytest

from consumers.inference.engine.batch import BatchEngine, GenRequest
from consumers.inference.engine.running import RunningBatch
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.model_loading import ModelSpec, encode_prompt, load_model
from consumers.inference.pool import ModelPool
from consumers.inference.runners.factory import RunnerFactory
from consumers.inference.runners.thread import EngineRunner
from consumers.inference.settings import InferenceSettings
from consumers.inference.worker.worker import InferenceService
from tests.conftest import STORIES, STORY_PROMPTS
from tests.unit.test_engine import run, tokens

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TURNS = [
    "Once upon a time",
    "The little cat",
    "Tom had a red ball",
    "One day, a bird",
    "Lily went to the park",
    "Mom said",
]
BUDGET = 64 << 20


@pytest.fixture(scope="module")
def loaded():
    return load_model(ModelSpec(name="stories-260k", path=str(STORIES), dtype="float32"))


def converse(loaded, engine_for, params: SamplingParams, neighbours: int) -> tuple[list[list[int]], list[int]]:
    """Each turn's answer tokens, and its prompt's length; ``engine_for(turn)`` answers it,
    with ``neighbours`` story requests added a step before it (running when it arrives)."""
    messages: list[dict] = []
    answers, lengths = [], []
    for turn, content in enumerate(TURNS):
        messages.append({"role": "user", "content": content})
        prompt = encode_prompt(loaded, messages)
        engine = engine_for(turn)
        others = [
            GenRequest(
                f"n{turn}-{i}",
                loaded.tokenizer(STORY_PROMPTS[i]).input_ids,
                SamplingParams(temperature=0, max_tokens=12 + i),
            )
            for i in range(neighbours)
        ]
        req = GenRequest(f"t{turn}", prompt, params)
        answer = tokens(run(engine, {0: others, 1: [req]})[req.request_id])
        answers.append(answer)
        lengths.append(len(prompt))
        text = loaded.tokenizer.decode([t for t in answer if t not in loaded.eos_ids], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
    return answers, lengths


GREEDY = SamplingParams(temperature=0, max_tokens=48)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=48, seed=7)


@pytest.mark.parametrize(
    ("params", "neighbours", "pack"),
    [(GREEDY, 0, False), (GREEDY, 3, True), (SEEDED, 3, False), (SEEDED, 0, True)],
    ids=["greedy-alone", "greedy-batched-packed", "seeded-batched", "seeded-alone-packed"],
)
def test_a_conversation_with_the_prefix_cache_is_token_identical_to_cold_prefills(loaded, pack, neighbours, params):
    cached = BatchEngine(loaded, "continuous", pack=pack, prefix_cache_bytes=BUDGET)
    warm, lengths = converse(loaded, lambda turn: cached, params, neighbours)
    cold, _ = converse(loaded, lambda turn: BatchEngine(loaded, "continuous", pack=pack), params, neighbours)
    assert warm == cold
    stats = cached.prefix.stats
    # Every turn from the third found the previous one's sequence, and reused most of its
    # prompt. (The second need not: stories260K has no chat template, and the fallback joins
    # the first prompt and its answer with a blank line the model never saw, which leaves
    # a shared prefix of the first prompt's few tokens, under a block.)
    assert stats.hits >= len(TURNS) - 2, stats
    assert stats.reused_tokens >= sum(lengths[1:]) // 2, (stats, lengths)


async def test_a_reloaded_or_evicted_model_starts_with_an_empty_cache():
    """The cache is its engine's, and an engine its model version's: a reload (new
    weights) gets a new engine with nothing cached, and the old one goes with its model."""
    pool = ModelPool([ModelSpec(name="stories-260k", path=str(STORIES))], budget_bytes=1 << 30)
    service = InferenceService(InferenceSettings(engine_process=False, prefix_cache_mb=1), pool, publish=None)
    service.runners.factory = RunnerFactory(service.engine_config, asyncio.get_running_loop(), service.on_outputs)
    async with pool.use("stories-260k") as old:
        first = service.runners.get(old)
        assert isinstance(first, EngineRunner) and first.engine.prefix is not None
        assert first.engine.prefix.budget_bytes == 1 << 20
        first.engine.prefix.store(list(range(40)), "kv", 100)
    await pool.reload("stories-260k")
    assert service.prune_runners() == [first]
    first.stop()
    async with pool.use("stories-260k") as new:
        second = service.runners.get(new)
        assert second is not first and second.engine.prefix is not None
        assert second.engine.prefix.stats.entries == 0
    second.stop()


def test_a_request_taken_over_from_another_worker_prefills_cold(loaded):
    """A request continued from delivered chunks (resume_ids) looks nothing up, whatever
    the cache holds: the takeover path is as it was, and its tokens those of an unbroken run."""
    engine = BatchEngine(loaded, "continuous", prefix_cache_bytes=BUDGET)
    prompt = loaded.tokenizer(" ".join(STORY_PROMPTS)).input_ids
    whole = tokens(run(engine, {0: [GenRequest("first", prompt, GREEDY)]})["first"])
    assert engine.prefix is not None and engine.prefix.stats.entries == 1
    before = engine.prefix.stats
    resumed = GenRequest("taken-over", prompt, GREEDY, resume_ids=whole[:10])
    assert whole[:10] + tokens(run(engine, {0: [resumed]})["taken-over"]) == whole
    after = engine.prefix.stats
    assert (after.hits, after.misses, after.reused_tokens) == (before.hits, before.misses, before.reused_tokens)


def test_a_request_kept_out_of_the_cache_neither_counts_nor_stores(loaded):
    """`GenRequest.cache` False (the runner's step profile: prompts that are no one's):
    no lookup, so no miss or hit counted, and nothing stored; its tokens are the same."""
    engine = BatchEngine(loaded, "continuous", prefix_cache_bytes=BUDGET)
    prompt = loaded.tokenizer(STORY_PROMPTS[0]).input_ids
    outs = [tokens(run(engine, {0: [GenRequest(f"p{i}", prompt, GREEDY, cache=False)]})[f"p{i}"]) for i in range(2)]
    stats = engine.stats().prefix
    assert stats is not None and (stats.hits, stats.misses, stats.entries) == (0, 0, 0)
    kept = tokens(run(engine, {0: [GenRequest("kept", prompt, GREEDY)]})["kept"])
    assert outs[0] == outs[1] == kept and engine.stats().prefix.misses == 1 and engine.stats().prefix.entries == 1


def _counting_extends(monkeypatch) -> list[str]:
    """The requests whose prefix hits were prefilled in passes of their own."""
    extends: list[str] = []
    extend = RunningBatch._extend

    def counted(self, seq):
        extends.append(seq.req.request_id)
        return extend(self, seq)

    monkeypatch.setattr(RunningBatch, "_extend", counted)
    return extends


def test_a_hit_rides_in_the_running_batchs_packed_pass(loaded, monkeypatch):
    """With requests running when a turn arrives, its prefix hit's new tokens go through
    the running batch's packed pass (attending over the cached keys and values), not a
    pass of their own, and its answer is a cold prefill's."""
    cold, _ = converse(loaded, lambda turn: BatchEngine(loaded, "continuous", pack=True), GREEDY, 3)
    extends = _counting_extends(monkeypatch)
    cached = BatchEngine(loaded, "continuous", pack=True, prefix_cache_bytes=BUDGET)
    warm, _ = converse(loaded, lambda turn: cached, GREEDY, 3)
    assert warm == cold
    assert cached.prefix.stats.hits >= len(TURNS) - 2 and extends == []


def test_a_failed_packed_pass_prefills_its_hits_apart(loaded, monkeypatch):
    """The packed pass raising: the running rows decode, the cold newcomers prefill and
    each hit prefills over its cached prefix, apart; the answers are still cold prefills'."""
    cold, _ = converse(loaded, lambda turn: BatchEngine(loaded, "continuous", pack=True), SEEDED, 3)
    extends = _counting_extends(monkeypatch)

    def broken(self, seqs):
        raise RuntimeError("simulated failure of the packed pass")

    monkeypatch.setattr(RunningBatch, "_packed_forward", broken)
    cached = BatchEngine(loaded, "continuous", pack=True, prefix_cache_bytes=BUDGET)
    warm, _ = converse(loaded, lambda turn: cached, SEEDED, 3)
    assert warm == cold
    assert len(extends) >= len(TURNS) - 2
