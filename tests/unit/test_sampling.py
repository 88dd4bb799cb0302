"""Tests of sampling parameters, per-request token selection and the text tracker."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from consumers.inference.sampling import SamplingParams, TextTracker, make_generator, select_tokens

pytestmark = pytest.mark.integration  # runs the real stories260K model in-process

STORIES = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K-hf"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0}, {"stop": [""]}]
)
def test_invalid_params_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_list_is_stored_as_tuple():
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop="end").stop == ("end",)
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop=("a",)))


def test_greedy_is_argmax_and_has_no_generator():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0)] * 3
    assert make_generator(params[0]) is None
    assert select_tokens(logits, params, [None] * 3) == logits.argmax(-1).tolist()


def _draw(logits_row, params, steps=20):
    gen = make_generator(params)
    return [select_tokens(logits_row[None], [params], [gen])[0] for _ in range(steps)]


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = torch.zeros(100)
    p = SamplingParams(temperature=1.0, seed=7)
    assert _draw(logits, p) == _draw(logits, p)
    assert _draw(logits, p) != _draw(logits, SamplingParams(temperature=1.0, seed=8))


def test_row_result_does_not_depend_on_batch_neighbours():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(5)]
    params[2] = SamplingParams(temperature=0)
    batched = select_tokens(logits, params, [make_generator(p) for p in params])
    alone = [select_tokens(logits[i : i + 1], [p], [make_generator(p)])[0] for i, p in enumerate(params)]
    assert batched == alone


def test_one_draw_per_step_and_global_rng_untouched():
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=123)
    gen = make_generator(params)
    reference = torch.Generator().manual_seed(123)
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(5))
    global_state = torch.get_rng_state()
    for _ in range(3):
        select_tokens(logits, [params], [gen])
        torch.rand(1, generator=reference)
        assert torch.equal(gen.get_state(), reference.get_state())
    assert torch.equal(torch.get_rng_state(), global_state)


def test_top_p_restricts_to_nucleus():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    seen = set(_draw(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=0), steps=300))
    assert seen == {0, 1}
    only_top = set(_draw(torch.randn(200), SamplingParams(temperature=2.0, top_p=1e-6, seed=0), steps=50))
    assert len(only_top) == 1


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.3]))
    draws = _draw(logits, SamplingParams(temperature=1.0, seed=3), steps=4000)
    share = draws.count(0) / len(draws)
    assert math.isclose(share, 0.7, abs_tol=0.03)
    # Low temperature sharpens towards the most likely token.
    cold = _draw(logits, SamplingParams(temperature=0.1, seed=3), steps=500)
    assert cold.count(0) / len(cold) > 0.99


def _split(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Token ids of ``prompt + completion`` split where the prompt's tokens end."""
    ids = tokenizer(prompt + completion).input_ids
    n = len(tokenizer(prompt).input_ids)
    return ids[:n], ids[n:]


def _feed(tracker, ids):
    return [tracker.add(i) for i in ids]


def test_tracker_keeps_leading_space_and_concatenates(tokenizer):
    prompt, gen = _split(tokenizer, "Once upon a time", " there was a dog.")
    tracker = TextTracker(tokenizer, prompt)
    deltas = [*_feed(tracker, gen), tracker.flush()]
    assert "".join(deltas) == " there was a dog."
    assert deltas[0] == " there"


def test_tracker_never_splits_a_multibyte_character(tokenizer):
    byte_ids = tokenizer.convert_tokens_to_ids(["<0xE4>", "<0xB8>", "<0xAD>"])  # "中"
    tracker = TextTracker(tokenizer, tokenizer("Hi").input_ids)
    assert _feed(tracker, byte_ids) == ["", "", "中"]


def test_tracker_ends_on_eos_without_a_replacement_character(tokenizer):
    """The end-of-turn token is skipped in the text: it is no half-decoded character."""
    prompt, gen = _split(tokenizer, "Once upon a time", " there was a dog.")
    tracker = TextTracker(tokenizer, prompt)
    deltas = [*_feed(tracker, [*gen, tokenizer.eos_token_id]), tracker.flush()]
    assert "".join(deltas) == " there was a dog." == tracker.text
    assert deltas[-2:] == ["", ""]


def test_tracker_leaves_out_a_character_cut_off_by_the_end(tokenizer):
    """max_tokens reached inside a multi-byte character: the text ends before it."""
    byte_ids = tokenizer.convert_tokens_to_ids(["▁a", "<0xE4>", "<0xB8>"])  # "中" without its last byte
    tracker = TextTracker(tokenizer, tokenizer("Hi").input_ids)
    assert "".join([*_feed(tracker, byte_ids), tracker.flush()]) == " a"


def test_tracker_survives_bytes_that_are_no_utf8(tokenizer):
    """tokenizers' DecodeStream raises on a stray continuation byte followed by a word
    (found by test_poison's random requests); the tracker decodes in full instead."""
    ids = tokenizer.convert_tokens_to_ids(["<0x00>", "<0x80>", "▁h", "▁t"])
    tracker = TextTracker(tokenizer, [tokenizer.bos_token_id])
    text = "".join([*_feed(tracker, ids), tracker.flush()])
    assert text.endswith(" h t")  # the bytes themselves decode to replacement characters


def test_tracker_trims_at_stop_string_and_holds_back_partial_match(tokenizer):
    prompt, gen = _split(tokenizer, "Once", " upon a time there was")
    tracker = TextTracker(tokenizer, prompt, stop=("a time",))
    deltas = []
    for tok in gen:
        deltas.append(tracker.add(tok))
        if tracker.stopped:
            break
    assert tracker.stopped
    assert tracker.text == " upon "
    assert "".join(deltas) == " upon "


def test_tracker_flushes_held_back_tail_when_no_stop_follows(tokenizer):
    prompt, gen = _split(tokenizer, "Once", " upon a time")
    tracker = TextTracker(tokenizer, prompt, stop=("time!",))
    deltas = _feed(tracker, gen)
    assert not "".join(deltas).endswith("time")  # could still become "time!"
    assert "".join(deltas) + tracker.flush() == " upon a time"
