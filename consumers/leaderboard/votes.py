"""Vote records and the count table every statistic is computed from.

A fit never looks at individual votes: it looks at how often each unordered pair of
models produced each outcome. The table is canonical (pair stored with the smaller
name first, the outcome flipped to match), so a vote and the same vote with sides
swapped and outcome flipped land in the same cell, and the order of votes is lost.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Outcome = Literal["a", "b", "tie", "both_bad"]
OUTCOMES: tuple[Outcome, ...] = ("a", "b", "tie", "both_bad")
"""Column order of `CountTable.counts`."""

# Score of the first-named model per outcome: a tie or both_bad is half a win each way.
OUTCOME_SCORE = np.array([1.0, 0.0, 0.5, 0.5])
_FLIP: dict[str, Outcome] = {"a": "b", "b": "a", "tie": "tie", "both_bad": "both_bad"}


@dataclass(frozen=True, slots=True)
class Vote:
    """One arena vote between two anonymous models."""

    model_a: str
    model_b: str
    outcome: Outcome
    """"a" (model_a won), "b" (model_b won), "tie", or "both_bad" (a tie where both were bad)."""
    tstamp: float | None = None
    """Unix time of the vote, when known; the online Elo trend runs in this order."""
    judge: str | None = None
    """Opaque voter id, when known; carried for the FastChat format, unused by the statistics."""
    conv_metadata: Mapping[str, Any] | None = field(default=None, hash=False)
    """FastChat's per-battle metadata (answer tokens and markdown counts per side); style control reads it."""
    categories: tuple[str, ...] = ()
    """The battle's categories (coding, math, a language, ...): the boards per category read them."""

    def __post_init__(self) -> None:
        check_vote(self.model_a, self.model_b, self.outcome)

    def swapped(self) -> Vote:
        """The same vote with the sides exchanged."""
        meta = None if self.conv_metadata is None else swap_sides(self.conv_metadata)
        return Vote(self.model_b, self.model_a, _FLIP[self.outcome], self.tstamp, self.judge, meta, self.categories)


def swap_sides(meta: Mapping[str, Any]) -> dict[str, Any]:
    """`conv_metadata` with side a's keys (`..._a`, `..._a_...`) and side b's exchanged."""
    out = {}
    for key, value in meta.items():
        new = key
        for mine, theirs in (("_a", "_b"), ("_b", "_a")):
            if key.endswith(mine):
                new = key[: -len(mine)] + theirs
            elif f"{mine}_" in key:
                new = key.replace(f"{mine}_", f"{theirs}_", 1)
            else:
                continue
            break
        out[new] = value
    return out


def check_vote(model_a: object, model_b: object, outcome: object) -> None:
    """Raise ValueError naming the bad field of a vote."""
    for name, value in (("model_a", model_a), ("model_b", model_b)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if model_a == model_b:
        raise ValueError(f"model_a and model_b are both {model_a!r}: a model cannot battle itself")
    if outcome not in _FLIP:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")


def canonical(model_a: str, model_b: str, outcome: str) -> tuple[str, str, Outcome]:
    """The vote's key in the count table: smaller model name first."""
    if model_a < model_b:
        return model_a, model_b, outcome  # type: ignore[return-value]
    return model_b, model_a, _FLIP[outcome]


@dataclass(frozen=True, eq=False)
class CountTable:
    """Outcome counts per unordered pair of models.

    `models` is sorted; `pairs[p] = (i, j)` with i < j indexes into it, rows sorted;
    `counts[p]` counts the outcomes in `OUTCOMES` order from model i's side.
    """

    models: tuple[str, ...]
    pairs: np.ndarray = field(repr=False)
    counts: np.ndarray = field(repr=False)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def index(self) -> dict[str, int]:
        return {m: i for i, m in enumerate(self.models)}

    def votes_per_model(self) -> dict[str, int]:
        """Votes each model took part in."""
        per_pair = self.counts.sum(axis=1)
        n = np.bincount(self.pairs[:, 0], per_pair, len(self.models)) + np.bincount(
            self.pairs[:, 1], per_pair, len(self.models)
        )
        return {m: int(v) for m, v in zip(self.models, n, strict=True)}

    def win_rates(self) -> dict[str, dict[str, float]]:
        """Pairwise empirical score: (wins + half the ties and both_bad) / games.

        `win_rates()[x][y]` is x's score against y; pairs that never met are absent.
        """
        out: dict[str, dict[str, float]] = {m: {} for m in self.models}
        games = self.counts.sum(axis=1)
        score = self.counts @ OUTCOME_SCORE
        for (i, j), n, s in zip(self.pairs.tolist(), games.tolist(), score.tolist(), strict=True):
            if n:
                out[self.models[i]][self.models[j]] = s / n
                out[self.models[j]][self.models[i]] = 1.0 - s / n
        return out

    def to_cells(self) -> dict[tuple[str, str, Outcome], int]:
        """Non-zero cells keyed by canonical (model_a, model_b, outcome)."""
        cells = {}
        for (i, j), row in zip(self.pairs.tolist(), self.counts.tolist(), strict=True):
            for outcome, c in zip(OUTCOMES, row, strict=True):
                if c:
                    cells[(self.models[i], self.models[j], outcome)] = c
        return cells

    @classmethod
    def from_cells(cls, cells: Mapping[tuple[str, str, str], int], models: Iterable[str] = ()) -> CountTable:
        """Build from counts keyed by (model_a, model_b, outcome) in any order of sides.

        `models` adds models that have no votes yet (they get a row and a rating of the gauge).
        """
        merged: Counter[tuple[str, str, Outcome]] = Counter()
        names = set(models)
        for (a, b, outcome), c in cells.items():
            check_vote(a, b, outcome)
            if c < 0:
                raise ValueError(f"negative count {c} for {(a, b, outcome)}")
            merged[canonical(a, b, outcome)] += int(c)
            names.update((a, b))
        ordered = tuple(sorted(names))
        idx = {m: i for i, m in enumerate(ordered)}
        pair_rows: dict[tuple[int, int], list[int]] = {}
        column = {o: k for k, o in enumerate(OUTCOMES)}
        for (a, b, outcome), c in merged.items():
            pair_rows.setdefault((idx[a], idx[b]), [0, 0, 0, 0])[column[outcome]] += c
        keys = sorted(pair_rows)
        pairs = np.array(keys, dtype=np.int64).reshape(-1, 2)
        counts = np.array([pair_rows[k] for k in keys], dtype=np.int64).reshape(-1, len(OUTCOMES))
        return cls(ordered, pairs, counts)

    def with_counts(self, counts: np.ndarray) -> CountTable:
        """The same pairs with other counts (a bootstrap resample)."""
        return CountTable(self.models, self.pairs, counts)


def aggregate(votes: Iterable[Vote | tuple[str, str, str]]) -> CountTable:
    """Count votes into a `CountTable`; accepts `Vote`s or (model_a, model_b, outcome) tuples."""
    keys = Counter(v[:3] if isinstance(v, tuple) else (v.model_a, v.model_b, v.outcome) for v in votes)
    return CountTable.from_cells(keys)
