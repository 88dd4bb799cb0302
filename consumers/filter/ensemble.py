"""Stages side by side, and one operating point for them chosen on benign data only.

Calibration. A stage's score (a sigmoid of a logit) is a ranking, not a probability,
and two stages' scores are not on one scale. Each stage therefore keeps a *benign
reference*: the sorted logits of the benign training prompts, each scored by a model
that did not train on that prompt's source family (leave-one-source-out). A prompt's
calibrated score under a stage is the share of the reference strictly below its logit;
its *benign tail* is the rest, the share of held-out benign prompts scoring at least as
high (``benign_tail`` on the event: 0.002 means 0.2% of benign prompts from sources the
stage never saw score this high).

Operating point. The ensemble's calibrated score is the largest over its enforced
stages, so a prompt is flagged when any stage ranks it above a common benign quantile
``q``; ``q`` is the lowest flagging at most the cap (0.3%) of the benign references'
prompts, pooled, which no attack score enters. Each stage's own threshold is then the
logit where its calibrated score reaches ``q``. One point is chosen for every set of
stages that may be enforced, since turning a stage on (or off) moves the others'.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from consumers.filter import heldout

if TYPE_CHECKING:
    from consumers.filter.classifier import Classifier

__all__ = [
    "ENSEMBLE_FORMAT",
    "Ensemble",
    "Member",
    "below_share",
    "load_ensemble",
    "operating_point",
    "operating_points",
    "stage_threshold",
    "write_manifest",
]


def below_share(reference: np.ndarray, z):
    """Share of the sorted ``reference`` strictly below ``z`` (a logit, or an array of them)."""
    return np.searchsorted(reference, z, side="left") / len(reference)


def stage_threshold(reference: np.ndarray, quantile: float) -> float:
    """The lowest logit whose :func:`below_share` reaches ``quantile`` (inf when none does)."""
    n = len(reference)
    need = np.flatnonzero(np.arange(n + 1) / n >= quantile)  # the same division as below_share
    if not len(need):
        return math.inf
    k = int(need[0])  # flagged when at least k reference logits lie below: z > reference[k - 1]
    return -math.inf if k == 0 else float(np.nextafter(reference[k - 1], np.inf))


def operating_point(benign: Mapping[str, np.ndarray], fp_cap: float) -> tuple[float, dict[str, float]]:
    """The common quantile and each stage's logit threshold for the stages of ``benign``
    (stage -> the held-out benign logits, the same rows in the same order for every stage)."""
    references = {name: np.sort(z) for name, z in benign.items()}
    calibrated = np.max([below_share(references[name], z) for name, z in benign.items()], axis=0)
    q = heldout.threshold_at(calibrated, fp_cap)
    return q, {name: stage_threshold(ref, q) for name, ref in references.items()}


def operating_points(benign: Mapping[str, np.ndarray], fp_cap: float) -> list[dict[str, object]]:
    """:func:`operating_point` for every non-empty set of the stages, thresholds as sigmoids."""
    names: Sequence[str] = list(benign)
    points = []
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(names, size):
            q, logits = operating_point({n: benign[n] for n in subset}, fp_cap)
            points.append(
                {
                    "enforced": list(subset),
                    "quantile": q,
                    "thresholds": {n: _sigmoid(t) for n, t in logits.items()},
                    "logits": logits,
                }
            )
    return points


def _sigmoid(z: float) -> float:
    if z == math.inf:
        return 1.0 + 1e-9  # never reached by a score
    return float(1.0 / (1.0 + np.exp(-z)))


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


def load_ensemble(path: str | Path) -> Ensemble:
    """An ensemble manifest (JSON) and the artifacts it names, beside it; each artifact must be
    the version the manifest was written for (its operating point belongs to those weights)."""
    from consumers.filter.classifier import load_stage  # noqa: PLC0415 - classifier.py loads manifests too

    p = Path(path)
    manifest = json.loads(p.read_text(encoding="utf-8"))
    if manifest.get("format") != ENSEMBLE_FORMAT:
        raise ValueError(f"{p}: not a filter ensemble manifest (format {manifest.get('format')!r})")
    members = []
    for stage in manifest["stages"]:
        clf = load_stage(p.parent / stage["artifact"])
        if clf.version != stage["version"]:
            raise ValueError(
                f"{p}: stage {stage['name']} expects {stage['version']}, {stage['artifact']} is {clf.version};"
                " retrain with `arena filter-train` (it writes the artifacts and the manifest together)"
            )
        reference = getattr(clf, "benign_reference", None)
        if reference is None:
            raise ValueError(f"{p}: {stage['artifact']} has no benign reference to calibrate stage {stage['name']}")
        members.append(Member(stage["name"], clf, np.asarray(reference, dtype=np.float64)))
    points = {frozenset(pt["enforced"]): pt["thresholds"] for pt in manifest["operating_points"]}
    return Ensemble(str(manifest["version"]), members, points, manifest.get("report"))


def write_manifest(
    path: str | Path, stages: Sequence[dict[str, Any]], points: list[dict[str, Any]], report: dict
) -> str:
    """Write the manifest atomically (written beside, then renamed: the filter reloads it whole);
    returns its version, a hash of the stages' versions and the operating points."""
    body = {
        "stages": list(stages),
        "operating_points": [{k: v for k, v in pt.items() if k != "logits"} for pt in points],
    }
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]
    version = f"ensemble-{'-'.join(s['name'] for s in stages)}-{digest}"
    manifest = {"format": ENSEMBLE_FORMAT, "version": version, **body, "report": report}
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(p)
    return version
