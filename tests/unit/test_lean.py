"""The lean decode step (lean.py) against transformers' forward, on the real stories260K
model: the same logits to the bit, so the same tokens, log probabilities and seeded
draws, with rows joining, leaving and padded, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from consumers.inference.engine import lean
from consumers.inference.engine.batch import BatchEngine, GenRequest
from consumers.inference.engine.kvcache import KVSlab
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.model_loading import ModelSpec, load_model
from tests.unit.test_engine import PROMPTS, STORIES, ids, run, tokens

pytestmark = pytest.mark.integration  # runs the real stories260K model in-process


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request):
    return load_model(ModelSpec(name="stories-260k", path=str(STORIES), dtype=request.param))


def _requests(loaded) -> list[GenRequest]:
    reqs = []
    for i, text in enumerate(PROMPTS):
        if i % 2:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=12 + 4 * i, logprobs=2)
        else:
            params = SamplingParams(temperature=0, max_tokens=12 + 4 * i, logprobs=0)
        reqs.append(GenRequest(f"r{i}", ids(loaded, text), params))
    return reqs


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []
    step = lean.decode_step

    def counted(model, ids, mask, pos, slab):
        calls.append(ids.shape[0])
        return step(model, ids, mask, pos, slab)

    monkeypatch.setattr(lean, "decode_step", counted)
    return calls


def test_a_packing_llama_decodes_lean_and_nothing_else_does(loaded):
    assert lean.supported(loaded.model)
    assert BatchEngine(loaded, "continuous", pack=True).lean
    assert not BatchEngine(loaded, "continuous", pack=True, lean=False).lean
    assert not BatchEngine(loaded, "continuous", pack=False).lean  # its attention is transformers' own SDPA
    assert not BatchEngine(loaded, "static", pack=True).lean
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16))
    assert not lean.supported(gpt2)


def test_a_llama_with_a_part_of_its_own_is_not_lean(monkeypatch):
    """A layer whose norm (or attention, or MLP) computes otherwise than transformers'
    Llama would be computed wrong: such a model keeps transformers' forward."""
    model = load_model(ModelSpec(name="s", path=str(STORIES))).model

    class OtherNorm(type(model.model.layers[0].input_layernorm)):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    model.model.layers[1].post_attention_layernorm.__class__ = OtherNorm
    assert not lean.supported(model)


def test_its_logits_are_transformers_to_the_bit_and_write_the_same_column(loaded):
    """One decode step over a padded slab of three rows: the lean step's logits and the
    keys and values it writes are bitwise transformers' forward's."""
    engine = BatchEngine(loaded, "continuous", max_batch_size=4, pack=True, lean=False)
    for req in _requests(loaded)[:3]:
        engine.add(req)
    engine.step()  # the prefill: three rows of different lengths, left-padded
    engine.step()
    kv = engine.batch.kv
    twin = KVSlab(kv.max_rows)
    twin.reset(
        [
            (k[: kv.n, :, kv.start : kv.end].clone(), v[: kv.n, :, kv.start : kv.end].clone())
            for k, v in zip(kv.keys, kv.values, strict=True)
        ],
        kv.mask.clone(),
    )
    assert not bool(kv.mask.all())  # the shorter rows are padded
    seqs = engine.batch.seqs
    ids_ = torch.tensor([[s.tokens[-1]] for s in seqs])
    pos = torch.tensor([[s.next_pos] for s in seqs])
    with torch.inference_mode():
        cache, mask = kv.step_inputs()
        expected = engine.batch.forward(ids_, mask, pos, cache)
        _, twin_mask = twin.step_inputs()
        got = lean.decode_step(loaded.model, ids_, twin_mask, pos, twin)
    assert torch.equal(got, expected)
    for layer in range(len(kv.keys)):
        assert torch.equal(twin.keys[layer][: twin.n, :, twin.end], kv.keys[layer][: kv.n, :, kv.end])
        assert torch.equal(twin.values[layer][: twin.n, :, twin.end], kv.values[layer][: kv.n, :, kv.end])


def test_a_batch_decoded_lean_answers_as_transformers_forward(loaded, monkeypatch):
    """Rows arriving at different steps, finishing at different lengths, greedy and
    seeded: the same tokens, texts and log probabilities either way."""
    reqs = _requests(loaded)
    arrivals = {0: reqs[:3], 2: reqs[3:5], 6: [reqs[5]], 9: reqs[6:]}
    through = run(BatchEngine(loaded, "continuous", max_batch_size=8, pack=True, lean=False), dict(arrivals))
    calls = _counting(monkeypatch)
    engine = BatchEngine(loaded, "continuous", max_batch_size=8, pack=True)
    assert engine.lean
    leaned = run(engine, dict(arrivals))
    assert len(calls) > 20 and max(calls) > 3  # it ran the batch's decode steps
    assert {r: tokens(o) for r, o in leaned.items()} == {r: tokens(o) for r, o in through.items()}
    for rid, outs in leaned.items():
        assert "".join(o.new_text for o in outs) == "".join(o.new_text for o in through[rid])
        assert [o.logprobs for o in outs] == [o.logprobs for o in through[rid]]
        assert outs[-1].finish_reason == through[rid][-1].finish_reason


def test_a_failing_lean_step_costs_its_batch_nothing_but_time(loaded, monkeypatch):
    """The lean step raising: transformers' forward runs that step (rewriting the column
    the lean one had begun), and, since it passed, every later one; every answer is the same."""
    reqs = _requests(loaded)[:4]
    expected = run(BatchEngine(loaded, "continuous", max_batch_size=4, pack=True, lean=False), {0: reqs})
    failures: list[int] = []

    def broken(model, ids, mask, pos, slab):
        failures.append(ids.shape[0])
        slab.keys[0][: slab.n, :, slab.end] = float("nan")  # a column begun, then the failure
        raise RuntimeError("simulated failure of the lean step")

    monkeypatch.setattr(lean, "decode_step", broken)
    engine = BatchEngine(loaded, "continuous", max_batch_size=4, pack=True)
    outs = run(engine, {0: reqs})
    assert failures == [4] and not engine.lean
    assert {r: tokens(o) for r, o in outs.items()} == {r: tokens(o) for r, o in expected.items()}
    assert all(o[-1].finish_reason != "error" for o in outs.values())
