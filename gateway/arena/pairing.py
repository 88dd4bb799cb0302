"""Choosing the two models of a battle, as FastChat's arena does (pure logic).

A first model is drawn by weight (a boosted model's weight times `BOOST`), then a rival
among the others by weight; when the first model has battle targets, each target's
weight is raised to the total weight over the number of targets (FastChat's boost to
about one chance in five). A model never meets itself, a model with no resident
inference worker has weight 0, and with nothing configured every model weighs 1. The
pair is then swapped with probability 1/2, so neither side favours the first pick.

Two more, LMArena's: a model with fewer than `boost_until` counted votes is boosted like
a listed one (LMArena: weight 5 until 3,000 votes), and `sampling="active"` draws the
pair by how much one more vote shrinks its interval (Chatbot Arena paper, section 5:
P(pair) ∝ sqrt(Σ/(n+1)) - sqrt(Σ/(n+2)), Σ the variance of the pair's outcome, n its
votes; the paper's n and n+1, smoothed by one so that a pair never seen is finite).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

BOOST = 5.0


class NoPair(ValueError):
    """Fewer than two models can battle now."""


@dataclass(frozen=True)
class PairPolicy:
    """How pairs are drawn; its `version` is recorded in every BattleStarted."""

    weights: Mapping[str, float] = field(default_factory=dict)
    """Sampling weight per model; empty: every model 1, else a model left out weighs 0."""
    boost: Sequence[str] = ()
    """Models drawn `BOOST` times as often as their weight says (new models to rate)."""
    targets: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """model -> rivals it should mostly meet."""
    boost_until: int = 0
    """Models with fewer counted votes than this are boosted too (0: only `boost`)."""
    sampling: str = "weighted"
    """'weighted' (the above) or 'active' (the pair whose interval one vote shrinks most)."""

    @property
    def version(self) -> str:
        targets = {k: sorted(v) for k, v in self.targets.items()}
        spec: dict = {"w": dict(self.weights), "b": sorted(self.boost), "t": targets}
        if self.sampling != "weighted":
            spec["s"] = self.sampling
        text = json.dumps(spec, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def with_votes(self, votes: Mapping[str, int], models: Sequence[str]) -> PairPolicy:
        """This policy with every model under `boost_until` counted votes boosted (the version says which)."""
        if not self.boost_until:
            return self
        new = {m for m in models if votes.get(m, 0) < self.boost_until}
        return replace(self, boost=tuple(sorted(set(self.boost) | new)), boost_until=0)

    def weight(self, model: str, resident: set[str]) -> float:
        if model not in resident:
            return 0.0
        w = float(self.weights.get(model, 0.0)) if self.weights else 1.0
        return w * BOOST if model in self.boost else w

    def rival_weights(self, chosen: str, models: Sequence[str], resident: set[str]) -> dict[str, float]:
        """Weights of the rivals of `chosen` (FastChat's `get_battle_pair`)."""
        total = sum(self.weight(m, resident) for m in models)
        aims = self.targets.get(chosen, ())
        out = {}
        for m in models:
            if m == chosen:
                continue
            w = self.weight(m, resident)
            if w and m in aims:
                w = total / len(aims)
            out[m] = w
        return out


@dataclass(frozen=True)
class Pair:
    model_a: str  # left pane
    model_b: str  # right pane
    swapped: bool
    probability: float  # of the unordered pair
    policy_version: str


def pair_probability(policy: PairPolicy, models: Sequence[str], resident: set[str], x: str, y: str) -> float:
    """P({x, y}) = P(x first) P(y | x) + P(y first) P(x | y)."""
    first = {m: policy.weight(m, resident) for m in models}
    total = sum(first.values())
    p = 0.0
    for one, other in ((x, y), (y, x)):
        if not total or not first[one]:
            continue
        rivals = policy.rival_weights(one, models, resident)
        rtotal = sum(rivals.values())
        if rtotal:
            p += first[one] / total * rivals.get(other, 0.0) / rtotal
    return p


def _draw(rng: random.Random, weights: Mapping[str, float]) -> str:
    names = sorted(weights)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def sample_pair(
    policy: PairPolicy, models: Sequence[str], resident: set[str], rng: random.Random | None = None
) -> Pair:
    """Draw a battle's two models among `models` (those with no resident worker excluded)."""
    rng = rng or random.Random()
    models = sorted(set(models))
    first = {m: policy.weight(m, resident) for m in models}
    if sum(1 for w in first.values() if w > 0) < 2:
        raise NoPair(f"{sum(1 for w in first.values() if w > 0)} model(s) can battle now; a battle needs two")
    chosen = _draw(rng, {m: w for m, w in first.items() if w > 0})
    rivals = {m: w for m, w in policy.rival_weights(chosen, models, resident).items() if w > 0}
    rival = _draw(rng, rivals)
    swapped = rng.random() < 0.5
    a, b = (rival, chosen) if swapped else (chosen, rival)
    return Pair(a, b, swapped, pair_probability(policy, models, resident, a, b), policy.version)


def active_probabilities(
    policy: PairPolicy, models: Sequence[str], resident: set[str], pairs: Mapping[tuple[str, str], tuple[int, float]]
) -> dict[tuple[str, str], float]:
    """P(pair) for active sampling; `pairs` maps a sorted pair to (votes, score variance)."""
    can = sorted(m for m in set(models) if policy.weight(m, resident) > 0)
    gain = {}
    for x, y in itertools.combinations(can, 2):
        n, var = pairs.get((x, y), (0, 0.25))
        var = max(var, 0.01)  # a pair decided every time still carries some uncertainty
        gain[(x, y)] = math.sqrt(var / (n + 1)) - math.sqrt(var / (n + 2))
    total = sum(gain.values())
    return {p: g / total for p, g in gain.items()} if total else {}


def active_pair(
    policy: PairPolicy,
    models: Sequence[str],
    resident: set[str],
    pairs: Mapping[tuple[str, str], tuple[int, float]],
    rng: random.Random | None = None,
) -> Pair:
    """Draw the pair by `active_probabilities`, then the random swap."""
    rng = rng or random.Random()
    probs = active_probabilities(policy, models, resident, pairs)
    if not probs:
        raise NoPair(f"{len({m for p in probs for m in p})} model(s) can battle now; a battle needs two")
    keys = sorted(probs)
    x, y = rng.choices(keys, weights=[probs[k] for k in keys])[0]
    swapped = rng.random() < 0.5
    a, b = (y, x) if swapped else (x, y)
    return Pair(a, b, swapped, probs[(x, y)], policy.version)


def pair_stats(board: Mapping | None) -> tuple[dict[str, int], dict[tuple[str, str], tuple[int, float]]]:
    """Votes per model and (votes, score variance) per pair from the stored leaderboard."""
    board = board or {}
    votes = {r["model"]: int(r["votes"]) for r in board.get("rows", ())}
    pairs = {}
    for x, y, wins, losses, *rest in board.get("pairs", ()):
        ties = rest[0] if rest else 0
        n = wins + losses + ties
        if n:
            mean = (wins + 0.5 * ties) / n
            pairs[(x, y)] = (n, (wins + 0.25 * ties) / n - mean**2)
    return votes, pairs
