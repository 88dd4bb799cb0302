"""Pair sampling: FastChat's weights, boosts and targets; never a model against itself."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from gateway.arena.pairing import (
    NoPair,
    PairPolicy,
    active_pair,
    active_probabilities,
    pair_probability,
    pair_stats,
    sample_pair,
)

pytestmark = pytest.mark.timeout(30)

MODELS = ["m1", "m2", "m3", "m4"]
ALL = set(MODELS)


def frequencies(policy, resident=ALL, n=20_000, seed=7):
    rng = random.Random(seed)
    pairs = [sample_pair(policy, MODELS, resident, rng) for _ in range(n)]
    return pairs, Counter(frozenset((p.model_a, p.model_b)) for p in pairs)


def test_uniform_when_nothing_is_configured_and_never_the_same_model():
    pairs, freq = frequencies(PairPolicy())
    assert all(p.model_a != p.model_b for p in pairs)
    assert len(freq) == 6
    for pair, count in freq.items():
        assert count / len(pairs) == pytest.approx(1 / 6, abs=0.015)
        assert pair_probability(PairPolicy(), MODELS, ALL, *sorted(pair)) == pytest.approx(1 / 6)


def test_random_swap_puts_each_model_on_either_side():
    pairs, _ = frequencies(PairPolicy(), n=4000)
    swapped = sum(p.swapped for p in pairs) / len(pairs)
    assert swapped == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize(
    "policy",
    [
        PairPolicy(weights={"m1": 4, "m2": 1, "m3": 1, "m4": 2}),
        PairPolicy(boost=["m3"]),
        PairPolicy(targets={"m1": ["m2"]}),
        PairPolicy(weights={"m1": 1, "m2": 3, "m3": 1}, boost=["m2"], targets={"m2": ["m3", "m4"]}),
    ],
)
def test_recorded_probability_matches_the_draws(policy):
    pairs, freq = frequencies(policy)
    probs = {frozenset(p): pair_probability(policy, MODELS, ALL, *p) for p in itertools.combinations(MODELS, 2)}
    assert sum(probs.values()) == pytest.approx(1.0)
    for pair, p in probs.items():
        assert freq.get(pair, 0) / len(pairs) == pytest.approx(p, abs=0.015)
    assert all(p.probability == pytest.approx(probs[frozenset((p.model_a, p.model_b))]) for p in pairs[:50])


def test_a_model_without_a_resident_worker_is_never_drawn():
    _, freq = frequencies(PairPolicy(), resident={"m1", "m2", "m3"}, n=2000)
    assert all("m4" not in pair for pair in freq)
    with pytest.raises(NoPair):
        sample_pair(PairPolicy(), MODELS, {"m1"})


def test_policy_version_changes_with_the_policy():
    assert PairPolicy().version != PairPolicy(boost=["m1"]).version
    assert PairPolicy(weights={"a": 1}).version == PairPolicy(weights={"a": 1}).version


def test_models_under_the_vote_threshold_are_boosted():
    policy = PairPolicy(boost_until=3000)
    votes = {"m1": 5000, "m2": 4000, "m3": 3500, "m4": 12}
    boosted = policy.with_votes(votes, MODELS)
    assert boosted.boost == ("m4",) and boosted.version != policy.version
    _, freq = frequencies(boosted)
    share = sum(c for pair, c in freq.items() if "m4" in pair) / sum(freq.values())
    assert share == pytest.approx(sum(pair_probability(boosted, MODELS, ALL, "m4", m) for m in MODELS[:3]), abs=0.015)
    assert share > 0.75  # 5x as often as a uniform draw's 1/2
    assert PairPolicy().with_votes(votes, MODELS) == PairPolicy()
    assert policy.with_votes({m: 9999 for m in MODELS}, MODELS).boost == ()


def test_active_sampling_favours_the_pair_one_vote_informs_most():
    board = {
        "rows": [{"model": m, "votes": 100} for m in MODELS],
        "pairs": [["m1", "m2", 40, 40, 20], ["m1", "m3", 95, 5, 0], ["m2", "m3", 3, 2, 0]],
    }
    votes, pairs = pair_stats(board)
    assert votes["m1"] == 100 and pairs[("m1", "m2")][0] == 100
    assert pairs[("m1", "m2")][1] == pytest.approx(0.2)  # ties score 0.5: variance below the decisive 0.25
    policy = PairPolicy(sampling="active")
    probs = active_probabilities(policy, MODELS, ALL, pairs)
    assert sum(probs.values()) == pytest.approx(1.0)
    # never-seen pairs first, then the least-voted, and the lopsided, well-voted pair last
    assert (
        min(probs[("m1", "m4")], probs[("m2", "m4")]) > probs[("m2", "m3")] > probs[("m1", "m2")] > probs[("m1", "m3")]
    )
    rng = random.Random(3)
    drawn = Counter()
    for _ in range(20_000):
        p = active_pair(policy, MODELS, ALL, pairs, rng)
        drawn[tuple(sorted((p.model_a, p.model_b)))] += 1
        assert p.probability == pytest.approx(probs[tuple(sorted((p.model_a, p.model_b)))])
    for pair, p in probs.items():
        assert drawn[pair] / 20_000 == pytest.approx(p, abs=0.015)
    assert "m4" not in {m for pair in active_probabilities(policy, MODELS, {"m1", "m2", "m3"}, pairs) for m in pair}


def test_a_battle_refused_for_want_of_models_names_those_not_loaded():
    """A models config of one's own warms its default model only: the others, served but
    not loaded, never battle until loaded, and the 503 says so and how to load them."""
    from gateway.arena.serving import unloaded

    assert unloaded(["tiny", "team-7b"], {"tiny"}) == (
        " (team-7b not loaded: a model battles once loaded; the models config's warm: list loads it at start)"
    )
    assert unloaded(["tiny"], {"tiny"}) == ""
