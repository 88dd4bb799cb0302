"""Tests of the stepping batch engine against the real stories260K model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from consumers.inference.engine.batch import BatchEngine, GenRequest, StepOutput, check_kv, check_room, kv_room
from consumers.inference.engine.kvcache import bytes_per_token
from consumers.inference.engine.running import RunningBatch
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.errors import ContextExceeded, KVBudgetExceeded, PermanentError, PromptTooLong
from consumers.inference.model_loading import ModelSpec, load_model

pytestmark = pytest.mark.integration  # runs the real stories260K model in-process

STORIES = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K-hf"

PROMPTS = [
    "Once upon a time",
    "Lily had a red ball. She",
    "The big dog ran to the park and saw a bird in the tall green tree. The dog",
    "Tom",
    "One day, a little boy named Ben went to the beach with his mom and dad.",
    "Sara liked to",
    "There was a cat who",
    "The sun was shining and the birds were singing. Anna wanted to go outside, but",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def loaded():
    return load_model(ModelSpec(name="stories-260k", path=str(STORIES)))


def ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer(text).input_ids


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(engine: BatchEngine, arrivals: dict[int, list[GenRequest]] | None = None) -> dict[str, list[StepOutput]]:
    """Step until idle, adding ``arrivals[step]`` before each step; outputs per request."""
    arrivals = dict(arrivals or {})
    outs: dict[str, list[StepOutput]] = {}
    step = 0
    while engine.has_work() or arrivals:
        for req in arrivals.pop(step, []):
            engine.add(req)
        assert engine.running <= engine.max_batch_size
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        step += 1
        assert step < 10_000
    return outs


def run_one(loaded, req: GenRequest) -> list[StepOutput]:
    return run(BatchEngine(loaded, "continuous"), {0: [req]})[req.request_id]


def tokens(outs: list[StepOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def alone(loaded, mode, req: GenRequest) -> list[int]:
    return tokens(run(BatchEngine(loaded, mode), {0: [req]})[req.request_id])


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_alone_matches_model_generate(loaded, prompt):
    prompt_ids = ids(loaded, prompt)
    expected = loaded.model.generate(
        torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=40, eos_token_id=None, pad_token_id=0
    )[0, len(prompt_ids) :].tolist()
    got = alone(loaded, "continuous", GenRequest("r", prompt_ids, SamplingParams(temperature=0, max_tokens=40)))
    # generate() stops at EOS too; compare up to and including it.
    if 2 in expected:
        expected = expected[: expected.index(2) + 1]
    assert got == expected


def _requests(loaded, sampled: bool) -> list[GenRequest]:
    reqs = []
    for i, text in enumerate(PROMPTS):
        params = (
            SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=20 + 5 * i)
            if sampled
            else (SamplingParams(temperature=0, max_tokens=20 + 5 * i))
        )
        reqs.append(GenRequest(f"r{i}", ids(loaded, text), params))
    return reqs


@pytest.mark.parametrize("mode", ["continuous", "static"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_batched_output_equals_alone(loaded, mode, sampled):
    reqs = _requests(loaded, sampled)
    solo = {r.request_id: run(BatchEngine(loaded, mode), {0: [r]})[r.request_id] for r in reqs}
    # Staggered arrivals: 3 at once, then others joining at different steps.
    arrivals = {0: reqs[:3], 2: reqs[3:5], 7: [reqs[5]], 11: reqs[6:]}
    outs = run(BatchEngine(loaded, mode, max_batch_size=8), arrivals)
    assert {rid: tokens(o) for rid, o in outs.items()} == {rid: tokens(o) for rid, o in solo.items()}
    for rid, o in outs.items():
        assert o[-1].finished and not any(x.finished for x in o[:-1])
        text = "".join(x.new_text for x in o)
        assert text == "".join(x.new_text for x in solo[rid])
        assert text.strip() == loaded.tokenizer.decode(tokens(o), skip_special_tokens=True).strip()
    if sampled:
        greedy = alone(loaded, mode, GenRequest("x", reqs[0].prompt_ids, GREEDY))
        assert tokens(solo["r0"]) != greedy[: len(solo["r0"])]


def test_continuous_lets_short_request_overtake(loaded):
    long = GenRequest("long", ids(loaded, PROMPTS[0]), SamplingParams(temperature=0, max_tokens=200))
    short = GenRequest("short", ids(loaded, PROMPTS[3]), SamplingParams(temperature=0, max_tokens=3))
    finished_at = {}
    for mode in ("continuous", "static"):
        engine = BatchEngine(loaded, mode)
        engine.add(long)
        step = 0
        while engine.has_work():
            if step == 5:
                engine.add(short)
            for out in engine.step():
                if out.finished:
                    finished_at[(mode, out.request_id)] = step
            step += 1
    assert finished_at[("continuous", "short")] == 5 + 2  # prefill + 2 decode steps
    assert finished_at[("continuous", "short")] < finished_at[("continuous", "long")]
    assert finished_at[("static", "short")] > finished_at[("static", "long")]


def test_static_admits_only_into_an_empty_batch(loaded):
    engine = BatchEngine(loaded, "static", max_batch_size=2)
    for i in range(3):
        engine.add(GenRequest(f"r{i}", ids(loaded, PROMPTS[i]), SamplingParams(temperature=0, max_tokens=4)))
    engine.step()
    assert (engine.running, engine.waiting) == (2, 1)
    engine.add(GenRequest("late", ids(loaded, PROMPTS[3]), SamplingParams(temperature=0, max_tokens=4)))
    for _ in range(2):  # tokens 2 and 3 of the first micro-batch; nobody joins
        engine.step()
        assert (engine.running, engine.waiting) == (2, 2)
    outs = engine.step()  # token 4 finishes the batch; the next two are admitted
    assert sorted(o.request_id for o in outs if o.finished) == ["r0", "r1"]
    assert (engine.running, engine.waiting) == (2, 0)


def test_cache_shrinks_when_long_rows_leave(loaded):
    engine = BatchEngine(loaded, "continuous")
    engine.add(GenRequest("long-prompt", ids(loaded, PROMPTS[2]), SamplingParams(temperature=0, max_tokens=2)))
    engine.add(GenRequest("short-prompt", ids(loaded, PROMPTS[3]), SamplingParams(temperature=0, max_tokens=30)))
    engine.step()
    wide = engine.batch.kv.width
    engine.step()  # long-prompt finishes; its padding columns go
    engine.step()
    assert engine.running == 1
    assert engine.batch.kv.width == len(ids(loaded, PROMPTS[3])) + 2
    assert engine.batch.kv.width < wide
    assert engine.batch.kv.window(0)[0].shape[2] == engine.batch.kv.mask.shape[1] == engine.batch.kv.width


def test_expired_waiting_request_finishes_without_compute(loaded):
    clock = Clock()
    engine = BatchEngine(loaded, "continuous", clock=clock)
    engine.add(GenRequest("late", ids(loaded, PROMPTS[0]), GREEDY, deadline=clock.now - 1))
    [out] = engine.step()
    assert (out.finish_reason, out.completion_tokens, out.new_token_ids) == ("deadline", 0, [])
    assert engine.running == 0 and not engine.has_work()


def test_running_request_past_deadline_finishes_at_next_step(loaded):
    clock = Clock()
    engine = BatchEngine(loaded, "continuous", clock=clock)
    engine.add(GenRequest("a", ids(loaded, PROMPTS[0]), GREEDY, deadline=clock.now + 10))
    engine.add(GenRequest("b", ids(loaded, PROMPTS[1]), GREEDY))
    engine.step()
    engine.step()
    clock.now += 11
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "deadline" and outs["a"].completion_tokens == 2
    assert not outs["b"].finished and outs["b"].completion_tokens == 3
    assert engine.running == 1


def test_cancel_waiting_and_running(loaded):
    engine = BatchEngine(loaded, "static", max_batch_size=1)
    engine.add(GenRequest("run", ids(loaded, PROMPTS[0]), GREEDY))
    engine.add(GenRequest("queued", ids(loaded, PROMPTS[1]), GREEDY))
    engine.step()
    engine.cancel("queued")
    engine.cancel("run")
    engine.cancel("unknown")  # ignored
    outs = {o.request_id: o for o in engine.step()}
    assert outs["queued"].finish_reason == "cancelled" and outs["queued"].completion_tokens == 0
    assert outs["run"].finish_reason == "cancelled" and outs["run"].completion_tokens == 1
    assert not engine.has_work()
    # The id may be reused once finished.
    engine.add(GenRequest("run", ids(loaded, PROMPTS[0]), GREEDY))
    assert engine.waiting == 1


def test_prompt_too_long_and_duplicates_rejected_at_add(loaded):
    engine = BatchEngine(loaded, "continuous")
    with pytest.raises(PromptTooLong) as err:
        engine.add(GenRequest("big", [1] * loaded.context_len, GREEDY))
    assert isinstance(err.value, PermanentError) and "512" in str(err.value)
    with pytest.raises(PermanentError):
        engine.add(GenRequest("empty", [], GREEDY))
    engine.add(GenRequest("dup", [1, 403], GREEDY))
    with pytest.raises(PermanentError):
        engine.add(GenRequest("dup", [1, 403], GREEDY))


def test_a_request_whose_prompt_and_max_tokens_are_over_the_context_is_refused(loaded):
    """As sent (check_room, at the worker's intake): refused with the room left named;
    the engine itself still clamps a resumed one (below)."""
    prompt = [1] * 500
    check_room(GenRequest("fits", prompt, SamplingParams(max_tokens=12)), loaded.context_len)
    with pytest.raises(ContextExceeded) as err:
        check_room(GenRequest("over", prompt, SamplingParams(max_tokens=13)), loaded.context_len)
    assert isinstance(err.value, PromptTooLong)
    assert str(err.value).startswith("max_tokens:") and "context of 512 tokens" in str(err.value)
    assert "at most 12" in str(err.value)


def test_max_tokens_clamped_to_context(loaded):
    prompt = (ids(loaded, PROMPTS[4]) * 40)[: loaded.context_len - 5]
    outs = run_one(loaded, GenRequest("r", prompt, SamplingParams(temperature=0, max_tokens=100, stop=("zzz",))))
    last = outs[-1]
    assert last.completion_tokens <= 5
    assert last.finish_reason == "length" or 2 in tokens(outs)


def test_stop_string_trims_text(loaded):
    prompt = ids(loaded, "Once upon a time")
    free = run_one(loaded, GenRequest("free", prompt, GREEDY))
    full_text = "".join(o.new_text for o in free)
    assert "Lily" in full_text
    stopped = run_one(loaded, GenRequest("s", prompt, SamplingParams(temperature=0, max_tokens=40, stop=("Lily",))))
    assert stopped[-1].finish_reason == "stop"
    assert "".join(o.new_text for o in stopped) == full_text[: full_text.index("Lily")]


def test_eos_finishes_with_stop(loaded):
    # Greedy stories rarely end on their own, so declare "." the end-of-sequence token.
    dot = loaded.tokenizer.convert_tokens_to_ids(".")
    engine = BatchEngine(dataclasses.replace(loaded, eos_ids=[dot]), "continuous")
    req = GenRequest("r", ids(loaded, "Once upon a time"), SamplingParams(temperature=0, max_tokens=400))
    outs = run(engine, {0: [req]})["r"]
    assert outs[-1].finish_reason == "stop"
    assert outs[-1].new_token_ids == [dot] and dot not in tokens(outs[:-1])
    assert outs[-1].completion_tokens == len(tokens(outs)) < 400


def test_ignore_eos_goes_on_past_the_end_of_sequence_to_max_tokens(loaded):
    """vLLM's and llama.cpp's `ignore_eos`: the end-of-sequence token is generated and
    decoding goes on; max_tokens (or a stop string) ends the answer. The same request
    without it ends at the first end of sequence, and the two agree until there."""
    dot = loaded.tokenizer.convert_tokens_to_ids(".")
    engine = BatchEngine(dataclasses.replace(loaded, eos_ids=[dot]), "continuous")
    prompt = ids(loaded, "Once upon a time")
    stops = GenRequest("stops", prompt, SamplingParams(temperature=0, max_tokens=48))
    goes_on = GenRequest("goes-on", prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    outs = run(engine, {0: [stops, goes_on]})
    ended, full = tokens(outs["stops"]), tokens(outs["goes-on"])
    assert outs["stops"][-1].finish_reason == "stop" and len(ended) < 48
    assert outs["goes-on"][-1].finish_reason == "length" and len(full) == 48
    assert full[: len(ended)] == ended and full.count(dot) > 1


def test_forward_error_fails_requests_not_engine(loaded, monkeypatch):
    engine = BatchEngine(loaded, "continuous")
    engine.add(GenRequest("ok", ids(loaded, PROMPTS[0]), GREEDY))
    engine.step()

    def boom(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(engine.batch, "model", boom)
    [out] = engine.step()
    assert (out.request_id, out.finish_reason) == ("ok", "error")
    assert not engine.has_work()
    monkeypatch.undo()
    three = SamplingParams(temperature=0, max_tokens=3)
    engine.add(GenRequest("after", ids(loaded, PROMPTS[0]), three))
    assert tokens(run(engine)["after"]) == alone(loaded, "continuous", GenRequest("x", ids(loaded, PROMPTS[0]), three))


def test_fail_all_finishes_everything_with_error(loaded):
    engine = BatchEngine(loaded, "static", max_batch_size=1)
    engine.add(GenRequest("running", ids(loaded, PROMPTS[0]), GREEDY))
    engine.add(GenRequest("queued", ids(loaded, PROMPTS[1]), GREEDY))
    engine.step()
    outs = {o.request_id: o for o in engine.fail_all()}
    assert {rid: (o.finished, o.finish_reason) for rid, o in outs.items()} == {
        "running": (True, "error"),
        "queued": (True, "error"),
    }
    assert not engine.has_work()
    engine.add(GenRequest("running", ids(loaded, PROMPTS[0]), GREEDY))  # ids are free again
    assert len(engine.step()) == 1


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_resumed_request_continues_where_the_first_worker_was(loaded, sampled):
    """A request taken over from a dead worker is prefilled with the tokens already
    delivered and continues with the same sampler state: the rest equals an unbroken run
    (text too), and it costs no steps for the part already done."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=48) if sampled else GREEDY
    prompt = ids(loaded, PROMPTS[1])
    whole = run_one(loaded, GenRequest("a", prompt, params))
    done = tokens(whole)[:17]
    resumed = run_one(loaded, GenRequest("b", prompt, params, resume_ids=done))
    assert tokens(resumed) == tokens(whole)[17:]
    assert resumed[-1].completion_tokens == whole[-1].completion_tokens
    assert resumed[-1].finish_reason == whole[-1].finish_reason
    delivered = loaded.tokenizer.decode(done, skip_special_tokens=True)
    assert (delivered + "".join(o.new_text for o in resumed)).strip() == "".join(o.new_text for o in whole).strip()
    assert len(resumed) <= len(whole) - 16  # one step per token not yet delivered


def test_a_resumed_request_that_was_already_complete_finishes_without_compute(loaded):
    params = SamplingParams(temperature=0, max_tokens=12)
    whole = run_one(loaded, GenRequest("a", ids(loaded, PROMPTS[0]), params))
    [out] = run_one(loaded, GenRequest("b", ids(loaded, PROMPTS[0]), params, resume_ids=tokens(whole)))
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert out.completion_tokens == 12


def _counting_packed(monkeypatch) -> list[int]:
    """Count the engine's packed passes (decode and newcomers' prefill in one)."""
    calls: list[int] = []
    real = RunningBatch._packed_forward

    def counted(self, seqs):
        calls.append(len(seqs))
        return real(self, seqs)

    monkeypatch.setattr(RunningBatch, "_packed_forward", counted)
    return calls


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_newcomers_ride_in_the_running_batchs_pass(loaded, sampled, monkeypatch):
    """A step that decodes the running rows and admits newcomers runs one packed pass;
    every request's tokens and text are those of the two-pass engine and of its run
    alone, a resumed newcomer's too."""
    reqs = _requests(loaded, sampled)
    first = run_one(loaded, dataclasses.replace(reqs[2], request_id="first"))
    reqs[2] = dataclasses.replace(reqs[2], resume_ids=tokens(first)[:5])

    def arrivals() -> dict[int, list[GenRequest]]:
        return {0: reqs[:2], 1: [reqs[2]], 3: reqs[3:5], 6: [reqs[5]], 9: reqs[6:]}

    apart = run(BatchEngine(loaded, "continuous", max_batch_size=8, pack=False), arrivals())
    calls = _counting_packed(monkeypatch)
    engine = BatchEngine(loaded, "continuous", max_batch_size=8, pack=True)
    assert engine.packed
    packed = run(engine, arrivals())
    assert calls == [1, 2, 1, 2], calls  # every arrival after the first joined running rows
    assert {r: tokens(o) for r, o in packed.items()} == {r: tokens(o) for r, o in apart.items()}
    assert {r: "".join(x.new_text for x in o) for r, o in packed.items()} == {
        r: "".join(x.new_text for x in o) for r, o in apart.items()
    }
    assert tokens(packed[reqs[2].request_id]) == tokens(first)[5:]
    for r in reqs:
        if not r.resume_ids:
            assert tokens(packed[r.request_id]) == alone(loaded, "continuous", r)


def test_a_failed_packed_pass_is_run_again_as_two(loaded, monkeypatch):
    """The packed pass raising costs nothing but time: the step decodes and prefills
    apart (where a failing row is isolated), and every answer is the same."""
    reqs = _requests(loaded, sampled=False)[:4]
    arrivals = {0: reqs[:2], 2: reqs[2:]}
    expected = {r.request_id: alone(loaded, "continuous", r) for r in reqs}
    failures = []

    def broken(self, seqs):
        failures.append(len(seqs))
        raise RuntimeError("simulated failure of the packed pass")

    monkeypatch.setattr(RunningBatch, "_packed_forward", broken)
    outs = run(BatchEngine(loaded, "continuous", max_batch_size=4, pack=True), arrivals)
    assert failures
    assert {r: tokens(o) for r, o in outs.items()} == expected
    assert all(o[-1].finish_reason != "error" for o in outs.values())


@pytest.mark.parametrize("pack", [False, True], ids=["two-passes", "packed"])
def test_a_bf16_model_batches_and_ends_every_request(pack):
    """bfloat16 weights (what `dtype: auto` picks for a big model on an AMX CPU): the KV
    slab, the masks, the packed attention and the sampler all take the model's dtype."""
    bf16 = load_model(ModelSpec(name="s", path=str(STORIES), dtype="bfloat16"))
    assert bf16.model.dtype == torch.bfloat16
    reqs = _requests(bf16, sampled=False)[:4] + _requests(bf16, sampled=True)[4:]
    arrivals = {0: reqs[:2], 1: reqs[2:4], 3: reqs[4:]}
    outs = run(BatchEngine(bf16, "continuous", max_batch_size=8, pack=pack), arrivals)
    assert set(outs) == {r.request_id for r in reqs}
    for r in reqs:
        assert outs[r.request_id][-1].finish_reason in ("stop", "length")
        assert 0 < len(tokens(outs[r.request_id])) <= r.params.max_tokens
    greedy = reqs[0]
    assert tokens(outs[greedy.request_id]) == alone(bf16, "continuous", greedy)


def test_static_batches_never_pack_and_a_tiny_model_only_when_asked(loaded):
    assert not BatchEngine(loaded, "static", pack=True).packed
    assert not BatchEngine(loaded, "continuous").packed  # stories260K: a pass is Python's time
    assert BatchEngine(loaded, "continuous", pack=True).packed


def test_the_kv_budget_holds_back_newcomers_and_changes_no_token(loaded):
    """A waiting request joins only while every row at its longest (prompt and whole
    budget: the slab is left-padded to its longest row) fits the budget; the others wait
    their turn, in order, and every request's tokens are those of an unbounded run."""
    reqs = _requests(loaded, sampled=False)
    per_token = bytes_per_token(loaded.model)
    assert per_token == 2 * 5 * 4 * 8 * 4  # layers, K and V, kv heads, head dim, float32
    longest = max(len(r.prompt_ids) + r.params.max_tokens for r in reqs)
    budget = 3 * longest * per_token  # three rows of the longest; more of shorter ones
    unbounded = run(BatchEngine(loaded, "continuous", max_batch_size=8), {0: reqs})
    engine = BatchEngine(loaded, "continuous", max_batch_size=8, kv_budget_bytes=budget)
    for r in _requests(loaded, sampled=False):
        engine.add(r)
    most, outs = 0, {}
    while engine.has_work():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        most = max(most, engine.running)
        rows = engine.batch.seqs
        assert len(rows) * max((len(s.req.prompt_ids) + s.max_tokens for s in rows), default=0) * per_token <= budget
    assert 1 < most < len(reqs)  # batched, but not all eight at once as without a budget
    assert {rid: tokens(o) for rid, o in outs.items()} == {rid: tokens(o) for rid, o in unbounded.items()}


def test_a_request_that_alone_is_over_the_kv_budget_is_refused(loaded):
    budget = 100 * bytes_per_token(loaded.model)  # 100 tokens a request at most
    assert kv_room(loaded, budget) == 100 and kv_room(loaded, None) is None
    assert kv_room(loaded, 10**12) == loaded.context_len
    prompt = ids(loaded, PROMPTS[0])
    check_kv(GenRequest("fits", prompt, SamplingParams(max_tokens=100 - len(prompt))), loaded, budget)
    with pytest.raises(KVBudgetExceeded, match=r"^max_tokens: .* over the 100 tokens .*ARENA_KV_CACHE_MB"):
        check_kv(GenRequest("over", prompt, SamplingParams(max_tokens=101 - len(prompt))), loaded, budget)


# ---- log probabilities, penalties, bias -------------------------------------------------


def _reference(loaded, prompt: list[int], steps: int, params: SamplingParams) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding by whole forward passes over the model's logits, penalties and bias
    applied by OpenAI's formula by hand; the tokens and each step's raw log-softmax."""
    seq, logps = list(prompt), []
    for _ in range(steps):
        raw = loaded.model(torch.tensor([seq])).logits[0, -1].float()
        logps.append(torch.log_softmax(raw, dim=-1))
        adj = raw.clone()
        done = seq[len(prompt) :]
        for tok in set(done):
            adj[tok] -= done.count(tok) * params.frequency_penalty + params.presence_penalty
        for tok, bias in params.logit_bias:
            adj[tok] += bias
        seq.append(int(adj.argmax()))
    return seq[len(prompt) :], logps


@torch.inference_mode()
def test_logprobs_are_the_models_log_softmax_batched_or_not(loaded):
    prompt = ids(loaded, "Once upon a time")
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=4)
    want_tokens, logps = _reference(loaded, prompt, 12, params)
    others = [GenRequest(f"o{i}", ids(loaded, p), GREEDY) for i, p in enumerate(PROMPTS[1:4])]
    outs = run(BatchEngine(loaded, "continuous"), {0: others[:2], 1: [GenRequest("r", prompt, params)], 3: others[2:]})
    mine = outs["r"]
    assert tokens(mine) == want_tokens
    got = [lp for o in mine for lp in o.logprobs]
    assert [lp.token_id for lp in got] == want_tokens
    for lp, ref in zip(got, logps, strict=True):
        assert lp.logprob == pytest.approx(float(ref[lp.token_id]), abs=1e-4)
        top = ref.topk(4)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert all(o.logprobs is None for o in outs["o0"])  # not asked: not computed


@torch.inference_mode()
def test_penalties_and_bias_change_greedy_output_as_openais_formula_says(loaded):
    prompt = ids(loaded, "Once upon a time")
    plain = alone(loaded, "continuous", GenRequest("p", prompt, SamplingParams(temperature=0, max_tokens=30)))
    for i, params in enumerate(
        [
            SamplingParams(temperature=0, max_tokens=30, frequency_penalty=1.5),
            SamplingParams(temperature=0, max_tokens=30, presence_penalty=2.0),
            SamplingParams(temperature=0, max_tokens=30, logit_bias={plain[0]: -100}),
        ]
    ):
        got = alone(loaded, "continuous", GenRequest(f"r{i}", prompt, params))
        assert got == _reference(loaded, prompt, len(got), params)[0]
        assert got != plain


def test_logit_bias_forces_a_token(loaded):
    word = loaded.tokenizer.convert_tokens_to_ids("▁Lily")
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=6, logit_bias={word: 100})
    outs = run_one(loaded, GenRequest("r", ids(loaded, "Once upon a time"), params))
    assert tokens(outs) == [word] * 6
    assert "".join(o.new_text for o in outs) == " Lily" * 6
