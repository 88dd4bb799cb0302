"""The ensemble's operating points, chosen on benign data only, and its manifest (at training).

Each stage's threshold is the logit where its calibrated score (consumers/filter/ensemble.py)
reaches a common benign quantile ``q``: the lowest flagging at most the cap (0.3%) of the
benign references' prompts, pooled, which no attack score enters. One point is chosen for
every set of stages that may be enforced.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.ensemble import ENSEMBLE_FORMAT, below_share
from lab.filter import heldout

__all__ = [
    "add_stage",
    "extend_manifest",
    "operating_point",
    "operating_points",
    "stage_threshold",
    "union_point",
    "write_manifest",
]


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


def union_point(references: Mapping[str, np.ndarray], fp_cap: float) -> dict[str, Any]:
    """Stages calibrated on different benign rows (the encoder's held-out fold beside the lexical stages'
    LOSO rows) cannot share a quantile row by row: each flags at most ``fp_cap / k`` of its own
    reference, so the k stages together flag at most ``fp_cap`` (the union bound)."""
    share = fp_cap / len(references)
    logits = {n: heldout.threshold_at(np.asarray(ref), share) for n, ref in references.items()}
    return {
        "enforced": list(references),
        "quantile": 1.0 - share,
        "thresholds": {n: _sigmoid(t) for n, t in logits.items()},
        "logits": logits,
    }


def add_stage(
    manifest_path: Path, name: str, artifact: Path, version: str, references: Mapping[str, np.ndarray], fp_cap: float
) -> str:
    """Add stage ``name`` (``artifact``, ``version``) to an ensemble manifest: the points of the sets without
    it are kept; every set with it gets a :func:`union_point` (``references``: every stage's own)."""
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    stages = [s for s in manifest["stages"] if s["name"] != name]
    others = [s["name"] for s in stages]
    points = [p for p in manifest["operating_points"] if name not in p["enforced"]]
    for size in range(len(others) + 1):
        for subset in itertools.combinations(others, size):
            points.append(union_point({n: references[n] for n in (*subset, name)}, fp_cap))
    relative = os.path.relpath(artifact.resolve(), manifest_path.resolve().parent)
    stages.append({"name": name, "artifact": relative, "version": version})
    report = dict(manifest.get("report", {}))
    report["union_calibrated"] = f"sets with {name}: each stage at fp_cap/k of its own benign reference"
    return write_manifest(manifest_path, stages, points, report)


def extend_manifest(lexical: Path, manifest: Path, name: str, artifact: Path, version: str, fp_cap: float) -> str:
    """Write ``manifest``: the stages of ``lexical`` (a manifest left as it is) and stage ``name``
    (:func:`add_stage`), its artifact paths relative to where it is written; returns its version."""
    from consumers.filter.loader import load_stage  # noqa: PLC0415 - onnxruntime: only for a stage that needs it

    document = json.loads(lexical.read_text(encoding="utf-8"))
    document["stages"] = [s for s in document["stages"] if s["name"] != name]
    paths = {s["name"]: lexical.parent / s["artifact"] for s in document["stages"]} | {name: artifact}
    references = {n: load_stage(p).benign_reference for n, p in paths.items()}  # type: ignore[attr-defined]
    for stage in document["stages"]:
        path = (lexical.parent / stage["artifact"]).resolve()
        stage["artifact"] = os.path.relpath(path, manifest.resolve().parent)
    manifest.write_text(json.dumps(document), encoding="utf-8")
    return add_stage(manifest, name, artifact, version, references, fp_cap)
