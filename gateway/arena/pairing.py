"""Choosing the two models of a battle, as FastChat's arena does (pure logic).

A first model is drawn by weight (a boosted model's weight times `BOOST`), then a rival
among the others by weight; when the first model has battle targets, each target's
weight is raised to the total weight over the number of targets (FastChat's boost to
about one chance in five). A model never meets itself, a model with no resident
inference worker has weight 0, and with nothing configured every model weighs 1. The
pair is then swapped with probability 1/2, so neither side favours the first pick.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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

    @property
    def version(self) -> str:
        text = json.dumps(
            {"w": dict(self.weights), "b": sorted(self.boost), "t": {k: sorted(v) for k, v in self.targets.items()}},
            sort_keys=True,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

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
