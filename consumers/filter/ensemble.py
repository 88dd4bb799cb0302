"""Stages side by side under one operating point, as the filter serves them.

Calibration. A stage's score (a sigmoid of a logit) is a ranking, not a probability,
and two stages' scores are not on one scale. Each stage therefore keeps a *benign
reference*: the sorted logits of benign prompts the stage did not train on (the
character and word stages: leave-one-source-out; the encoder: a held-out benign fold).
A prompt's calibrated score under a stage is the share of the reference strictly below
its logit; its *benign tail* is the rest, the share of held-out benign prompts scoring
at least as high (``benign_tail`` on the event: 0.002 means 0.2% of such benign prompts
score this high).

Operating point. A prompt is flagged when any enforced stage ranks it above a common
benign quantile; the manifest holds, for every set of stages that may be enforced, each
stage's threshold at that set's quantile (chosen on benign data only, by
lab/filter/calibrate.py at training). Turning a stage on (or off) moves the others'.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from consumers.filter.interface import Classifier

__all__ = ["ENSEMBLE_FORMAT", "Ensemble", "Member", "below_share"]


def below_share(reference: np.ndarray, z):
    """Share of the sorted ``reference`` strictly below ``z`` (a logit, or an array of them)."""
    return np.searchsorted(reference, z, side="left") / len(reference)


ENSEMBLE_FORMAT = "arenaflow-filter-ensemble/1"


@dataclass(frozen=True)
class Member:
    """One stage of a served ensemble."""

    name: str  # "chars", "words", ...: what the config's stage_modes and the events call it
    classifier: Classifier
    reference: np.ndarray  # sorted held-out benign logits (the calibration)

    def benign_tail(self, logit: float) -> float:
        """Share of the held-out benign prompts scoring at least ``logit``."""
        return float(1.0 - below_share(self.reference, logit))


class Ensemble:
    """The stages a manifest names (`arena filter-train` writes it beside their artifacts),
    and the operating point of every set of them that may be enforced."""

    def __init__(
        self,
        version: str,
        members: Sequence[Member],
        points: Mapping[frozenset[str], Mapping[str, float]],
        report: dict[str, Any] | None = None,
    ):
        names = [m.name for m in members]
        missing = [
            s for n in range(1, len(names) + 1) for s in itertools.combinations(names, n) if frozenset(s) not in points
        ]
        if missing:
            raise ValueError(f"ensemble has no operating point for the stages {sorted(missing[0])}")
        self.version = version
        self.members = tuple(members)
        self.points = {k: dict(v) for k, v in points.items()}
        self.blocking = any(m.classifier.blocking for m in members)
        self.report = report or {}  # the ensemble's held-out tables, recorded at training

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members)

    def thresholds(self, enforced: set[str]) -> dict[str, float]:
        """Each stage's threshold (a score) when the stages in ``enforced`` block: theirs from that
        set's point; a stage in shadow gets the one it would have if it were turned on too."""
        on = frozenset(enforced) & frozenset(self.names)
        out = {}
        for name in self.names:
            point = self.points[on | {name}]
            out[name] = float(point[name])
        return out
