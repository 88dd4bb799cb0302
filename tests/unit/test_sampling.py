"""Tests of sampling parameters, per-request token selection and the text tracker."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from consumers.inference.engine.sampling import (
    CDF_BLOCK,
    NUCLEUS_CANDIDATES,
    SamplingParams,
    TextTracker,
    _inverse_cdf,
    _inverse_cdf_whole,
    _sample_top_p,
    adjusted,
    make_generator,
    pick_tokens,
    select_tokens,
    token_logprobs,
)

pytestmark = pytest.mark.integration  # runs the real stories260K model in-process

STORIES = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K-hf"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(STORIES)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0}, {"stop": [""]}]
)
def test_invalid_params_rejected(kwargs):
    with pytest.raises(ValueError):  # by decoding, or by what the engine serves
        SamplingParams(**kwargs).checked()


def test_stop_list_is_stored_as_tuple():
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
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


def _sorted_nucleus(logits: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The nucleus sampler as it was: the whole vocabulary sorted for every row."""
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]
    keep[:, 0] = True
    cdf = (sorted_probs * keep).cumsum(dim=-1)
    pos = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)
    pos = torch.minimum(pos, keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    return order.gather(-1, pos).squeeze(-1)


def test_the_nucleus_found_among_the_top_candidates_or_by_a_full_sort_is_the_sorted_one():
    """A peaked row's nucleus lies among its NUCLEUS_CANDIDATES most likely tokens, a flat
    row's reaches past them (sorted whole): either way the token drawn for a uniform is
    the one a sort of the whole vocabulary gives, rows of both kinds in one batch."""
    g = torch.Generator().manual_seed(0)
    vocab = 4 * NUCLEUS_CANDIDATES
    ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(6)]).float() + 1
    logits = -2.0 * ranks.log()  # Zipf-like, peaked
    logits[3:] = torch.randn(3, vocab, generator=g) * 0.1  # nearly flat: the nucleus is wide
    top_p = torch.tensor([0.9, 0.5, 1e-9, 0.99, 0.9, 0.95])
    probs = torch.softmax(logits, dim=-1)
    mass = probs.topk(NUCLEUS_CANDIDATES, dim=-1).values.sum(dim=-1)
    assert (mass[:3] >= top_p[:3]).all() and (mass[3:] < top_p[3:]).all()  # both paths taken
    for _ in range(50):
        u = torch.rand(6, generator=g)
        picked, fine = _sample_top_p(logits, top_p, u)
        assert torch.equal(picked, _sorted_nucleus(logits, top_p, u)) and fine.all()


def test_top_p_one_draws_from_the_whole_distribution_and_never_a_token_of_probability_zero():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    logits = probs.log()[None].repeat(20000, 1)  # log(0) = -inf
    u = torch.rand(20000, generator=torch.Generator().manual_seed(1))
    u[:5] = torch.tensor([0.0, 1 - 1e-7, 0.5, 0.7, 0.9999999])
    picked, fine = _sample_top_p(logits, torch.ones(20000), u)
    counts = torch.bincount(picked, minlength=5).float() / 20000
    assert counts[1] == 0 and counts[4] == 0 and fine.all()
    torch.testing.assert_close(counts, probs, atol=0.015, rtol=0)


def test_the_blocked_draw_is_the_draw_over_one_cumulative_sum_of_the_vocabulary():
    """Blocks of CDF_BLOCK tokens (the last one padded), the block then the token within
    it: for the same uniform, the token one cumulative sum over the vocabulary gives, but
    where the two sums round apart at a boundary (then a neighbour)."""
    g = torch.Generator().manual_seed(2)
    vocab = 3 * CDF_BLOCK - 72
    probs = torch.softmax(torch.randn(8, vocab, generator=g) * 2, dim=-1)
    u = torch.rand(400, 8, generator=g)
    blocked = torch.stack([_inverse_cdf(probs, row) for row in u])
    whole = torch.stack([_inverse_cdf_whole(probs, row) for row in u])
    apart = blocked != whole
    assert apart.float().mean() < 0.005 and all(abs(d) <= 1 for d in (blocked - whole)[apart].tolist())


def test_greedy_rows_and_a_broken_row_beside_sampled_ones():
    """The greedy token is the argmax (the first of equal maxima); a row with a NaN, or
    with every logit -inf, gets no token, greedy or sampled."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, math.nan, 0.0, 2.0], [-math.inf] * 4, [0.0, 5.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1)]
    params.append(SamplingParams(temperature=0.5, seed=2))
    assert select_tokens(logits, params, [make_generator(p) for p in params]) == [1, None, None, 1]


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


# ---- penalties, bias, log probabilities -------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"logit_bias": {5: 101}},
        {"logit_bias": {-1: 1}},
        {"logprobs": 21},
        {"logprobs": -1},
    ],
)
def test_out_of_range_penalties_bias_and_logprobs_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs).checked()


def test_logit_bias_is_stored_as_sorted_pairs():
    assert SamplingParams(logit_bias={9: -1, 3: 2.5}).logit_bias == ((3, 2.5), (9, -1.0))
    assert hash(SamplingParams(logit_bias={3: 1})) == hash(SamplingParams(logit_bias=[(3, 1.0)]))


def test_penalties_and_bias_follow_openais_formula_row_by_row():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    history = [[5, 5, 7], [1, 2, 3], [5, 5, 5, 9]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: 3.0, 0: -100}),
        SamplingParams(),  # asks for nothing: untouched
        SamplingParams(frequency_penalty=-1.5),
    ]
    got = adjusted(logits, params, history)
    want = logits.clone()
    for row, (p, seen) in enumerate(zip(params, history, strict=True)):
        for tok in set(seen):
            want[row, tok] -= seen.count(tok) * p.frequency_penalty + p.presence_penalty
        for tok, bias in p.logit_bias:
            want[row, tok] += bias
    assert torch.allclose(got, want)
    assert got[1].equal(logits[1])
    assert adjusted(logits, [SamplingParams()] * 3, history) is logits  # no copy when none asks


def test_logit_bias_forces_and_bans_a_greedy_token():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    best = int(logits[0].argmax())
    forced = SamplingParams(temperature=0, logit_bias={11: 100})
    banned = SamplingParams(temperature=0, logit_bias={best: -100})
    assert pick_tokens(logits[:1], [forced], [None], [[]]) == [11]
    assert pick_tokens(logits[:1], [banned], [None], [[]])[0] != best


def test_a_frequency_penalty_moves_greedy_off_a_repeated_token():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 1.0
    p = SamplingParams(temperature=0, frequency_penalty=0.6)
    assert pick_tokens(logits, [p], [None], [[4]]) == [4]  # 1 - 0.6 > 0
    assert pick_tokens(logits, [p], [None], [[4, 4]]) != [4]  # 1 - 1.2 < 0


def test_penalised_rows_do_not_depend_on_their_batch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=g)
    history = [[int(t) for t in torch.randint(0, 300, (n,), generator=g)] for n in range(6)]
    params = [
        SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, presence_penalty=0.3 * i - 0.8, logit_bias={i: 2.0})
        for i in range(6)
    ]
    uniforms = [None if p.greedy else 0.1 * (i + 1) for i, p in enumerate(params)]
    together = pick_tokens(logits, params, uniforms, history)
    for i in range(6):
        assert pick_tokens(logits[i : i + 1], params[i : i + 1], uniforms[i : i + 1], history[i : i + 1]) == [
            together[i]
        ]
        mixed = [5 - i] if i != 5 - i else []  # beside another neighbour, in another place
        rows = [*mixed, i]
        got = pick_tokens(
            logits[rows], [params[r] for r in rows], [uniforms[r] for r in rows], [history[r] for r in rows]
        )
        assert got[-1] == together[i]


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)) * 4
    params = [
        SamplingParams(temperature=0.5, logprobs=5, logit_bias={1: 50}),  # sampled from adjusted logits...
        SamplingParams(),  # did not ask
        SamplingParams(temperature=0, logprobs=0),
    ]
    tokens = [1, 7, int(logits[2].argmax())]
    out = token_logprobs(logits, params, tokens)
    want = torch.log_softmax(logits, dim=-1)
    assert out[1] is None
    first, last = out[0], out[2]
    assert first is not None and last is not None
    assert first.token_id == 1 and math.isclose(first.logprob, float(want[0, 1]), abs_tol=1e-6)  # ...reported raw
    top = want[0].topk(5)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert last.top == () and math.isclose(last.logprob, float(want[2].max()), abs_tol=1e-6)
    assert token_logprobs(logits, [SamplingParams()] * 3, tokens) == [None] * 3
