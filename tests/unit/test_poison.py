"""One bad request must never end its batch: poison isolation in the engine (real stories260K)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.inference.engine import sequences as engine_module
from consumers.inference.engine.batch import BatchEngine, GenRequest, StepOutput
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.model_loading import ModelSpec, load_model
from tests.conftest import STORIES
from tests.unit.test_engine import PROMPTS, ids, run, tokens

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # runs the real stories260K model in-process

LONG = 100  # the poison's prompt length: no healthy row ever reaches this position


@pytest.fixture(scope="module")
def loaded():
    return load_model(ModelSpec(name="stories-260k", path=str(STORIES)))


def healthy(loaded) -> list[GenRequest]:
    """Eight neighbours: greedy and seeded rows, different prompt lengths and budgets."""
    reqs = []
    for i, text in enumerate(PROMPTS):
        params = (
            SamplingParams(temperature=0.8, top_p=0.9, seed=10 + i, max_tokens=12 + 2 * i)
            if i % 2
            else SamplingParams(temperature=0, max_tokens=12 + 2 * i)
        )
        reqs.append(GenRequest(f"ok{i}", ids(loaded, text), params))
    return reqs


def poison_request(loaded, params: SamplingParams | None = None) -> GenRequest:
    prompt = (ids(loaded, PROMPTS[4]) * 10)[:LONG]
    return GenRequest("poison", prompt, params or SamplingParams(temperature=0.7, seed=99, max_tokens=30))


@pytest.fixture(scope="module")
def reference(loaded):
    """Each healthy request's tokens when it runs without any poison in the batch."""
    return {rid: tokens(o) for rid, o in run(BatchEngine(loaded, "continuous"), {0: healthy(loaded)}).items()}


def check(outs: dict[str, list[StepOutput]], reference: dict[str, list[int]]) -> None:
    """The poison ends once with "error"; every neighbour ends once with its own tokens."""
    for rid, o in outs.items():
        assert [x.finished for x in o].count(True) == 1 and o[-1].finished, rid
    assert outs["poison"][-1].finish_reason == "error"
    assert {rid: tokens(outs[rid]) for rid in reference} == reference
    assert all(outs[rid][-1].finish_reason in ("stop", "length") for rid in reference)


@pytest.mark.parametrize("joins_at", [0, 3], ids=["in-prefill", "mid-decode"])
def test_row_whose_selection_raises_ends_alone(loaded, reference, monkeypatch, joins_at):
    poison = poison_request(loaded)
    real = engine_module.pick_tokens

    def pick(logits, params, uniforms, generated):
        if any(p is poison.params for p in params):
            raise RuntimeError("simulated sampler failure for one request")
        return real(logits, params, uniforms, generated)

    monkeypatch.setattr(engine_module, "pick_tokens", pick)
    arrivals = {0: healthy(loaded)}
    arrivals.setdefault(joins_at, []).append(poison)
    outs = run(BatchEngine(loaded, "continuous"), arrivals)
    check(outs, reference)
    assert tokens(outs["poison"]) == []


def _forward_failing(model, when):
    """The model, raising for any batch in which ``when(input_ids, position_ids)`` holds."""

    def forward(*args, input_ids, position_ids, **kwargs):
        if when(input_ids, position_ids):
            raise RuntimeError("simulated kernel failure on one row")
        return model(*args, input_ids=input_ids, position_ids=position_ids, **kwargs)

    return forward


@pytest.mark.parametrize("mode", ["continuous", "static"])
@pytest.mark.parametrize("fails_in", ["prefill", "decode"])
def test_forward_pass_that_raises_is_bisected_to_the_poison_row(loaded, reference, mode, fails_in):
    # prefill: the poison's prompt (positions up to LONG-1) breaks the forward pass;
    # decode: its fourth decode step does (position LONG+3), after it streamed tokens.
    limit = LONG - 1 if fails_in == "prefill" else LONG + 3
    engine = BatchEngine(loaded, mode, max_batch_size=9)
    engine.batch.model = _forward_failing(loaded.model, lambda _ids, pos: bool((pos >= limit).any()))
    outs = run(engine, {0: [*healthy(loaded), poison_request(loaded)]})
    check(outs, reference)
    assert len(tokens(outs["poison"])) == (0 if fails_in == "prefill" else 4)
    assert not engine.has_work() and engine.scheduler.active == {}


def test_non_finite_logits_end_only_their_row(loaded, reference, monkeypatch):
    """A row whose logits turn NaN (an fp16 overflow, say) is a per-row error, not an exception."""
    engine = BatchEngine(loaded, "continuous")
    model = loaded.model

    def forward(*args, position_ids, **kwargs):
        out = model(*args, position_ids=position_ids, **kwargs)
        bad = (position_ids[:, -1] >= LONG + 2).nonzero().flatten()
        out.logits[bad] = math.nan
        return out

    engine.batch.model = forward
    outs = run(engine, {0: healthy(loaded), 2: [poison_request(loaded)]})
    check(outs, reference)
    assert len(tokens(outs["poison"])) == 3  # from prefill and decodes at positions LONG, LONG + 1


def test_temperature_that_underflows_is_rejected_and_survived_if_it_slips_through(loaded, reference):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e-300).checked()
    # Were validation bypassed, 1e-300 (0 in float32) leaves nothing to sample: that row alone fails.
    params = SamplingParams(temperature=0.5, seed=1, max_tokens=30).model_copy(update={"temperature": 1e-300})
    outs = run(BatchEngine(loaded, "continuous"), {0: healthy(loaded), 1: [poison_request(loaded, params)]})
    check(outs, reference)


def test_top_p_that_underflows_keeps_the_top_token(loaded):
    prompt = ids(loaded, PROMPTS[0])
    tiny = run(BatchEngine(loaded, "continuous"), {0: [GenRequest("t", prompt, SamplingParams(top_p=1e-300, seed=3))]})
    greedy = run(BatchEngine(loaded, "continuous"), {0: [GenRequest("g", prompt, SamplingParams(temperature=0))]})
    assert tiny["t"][-1].finish_reason in ("stop", "length")
    assert tokens(tiny["t"]) == tokens(greedy["g"])


@pytest.mark.parametrize("pack", [False, True], ids=["two-passes", "packed"])
def test_a_step_that_raises_outside_the_model_still_ends_every_request(loaded, monkeypatch, pack):
    """fail_all (the runner's last resort) reaches requests a failed step took off the queue."""
    engine = BatchEngine(loaded, "continuous", pack=pack)
    engine.add(GenRequest("running", ids(loaded, PROMPTS[0]), SamplingParams(temperature=0)))
    engine.step()
    engine.add(GenRequest("newcomer", ids(loaded, PROMPTS[1]), SamplingParams(temperature=0)))
    engine.add(GenRequest("queued", ids(loaded, PROMPTS[2]), SamplingParams(temperature=0)))
    monkeypatch.setattr(engine.scheduler, "max_batch_size", 2)

    def broken_merge(*args):
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(engine.batch, "_merge", broken_merge)  # newcomers join through it after either pass
    with pytest.raises(RuntimeError):
        engine.step()  # "newcomer" was admitted, prefilled, then lost with the step
    outs = {o.request_id: o for o in engine.fail_all()}
    assert {rid: o.finish_reason for rid, o in outs.items()} == dict.fromkeys(
        ["running", "newcomer", "queued"], "error"
    )
    assert not engine.has_work()


# ---- property: whatever sampling parameters arrive, every request ends exactly once ----

temperatures = st.one_of(
    st.just(0.0),
    st.floats(0.01, 2.0),
    st.sampled_from([1e-300, 1e-45, 1e-40, 1e-8, 0.009, 1e30, 1e300, math.inf]),  # tiny / huge
)
top_ps = st.one_of(st.floats(1e-300, 1.0, exclude_min=False), st.sampled_from([1e-300, 1e-45, 1e-6, 1.0]))
stops = st.lists(st.text(min_size=1, max_size=4), max_size=3)
newcomer = st.tuples(
    st.text(max_size=60),  # the prompt
    temperatures,
    top_ps,
    st.integers(1, 24),  # max_tokens
    stops,
    st.integers(0, 2**63 - 1),  # seed
    st.integers(0, 6),  # the step it arrives at
)


def make_params(temperature, top_p, max_tokens, stop, seed) -> tuple[SamplingParams, bool]:
    """The params, and whether validation accepted them; rejected ones are forced through
    anyway, as if a path skipped validation, to show the engine survives them too."""
    given = dict(top_p=top_p, max_tokens=max_tokens, stop=tuple(stop), seed=seed)
    try:
        return SamplingParams(temperature=temperature, **given).checked(), True
    except ValueError:
        return SamplingParams(temperature=0.5, **given).model_copy(update={"temperature": temperature}), False


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(newcomers=st.lists(newcomer, min_size=1, max_size=3), mode=st.sampled_from(["continuous", "static"]))
def test_random_sampling_parameters_never_hurt_neighbours(loaded, reference, newcomers, mode):
    neighbours = healthy(loaded)[:4]
    expected = {r.request_id: reference[r.request_id] for r in neighbours}
    arrivals: dict[int, list[GenRequest]] = {0: list(neighbours)}
    valid = {}
    for n, (text, temperature, top_p, max_tokens, stop, seed, at) in enumerate(newcomers):
        params, valid[f"x{n}"] = make_params(temperature, top_p, max_tokens, stop, seed)
        arrivals.setdefault(at, []).append(GenRequest(f"x{n}", ids(loaded, text), params))
    outs = run(BatchEngine(loaded, mode, max_batch_size=6), arrivals)
    assert set(outs) == {r.request_id for r in neighbours} | set(valid)
    for rid, o in outs.items():
        assert [x.finished for x in o].count(True) == 1 and o[-1].finished, rid
    assert {r.request_id: tokens(outs[r.request_id]) for r in neighbours} == expected
    for rid, ok in valid.items():
        if ok:  # parameters that pass validation are served, never an error
            assert outs[rid][-1].finish_reason in ("stop", "length"), (rid, outs[rid][-1])


def test_params_rejected_by_validation_are_exactly_the_unservable_temperatures():
    for t in (1e-300, 1e-40, 0.009, math.inf, math.nan, -1.0):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=t).checked()
    for t in (0.0, 0.01, 1.0, 2.0):
        assert SamplingParams(temperature=t).checked().temperature == t
