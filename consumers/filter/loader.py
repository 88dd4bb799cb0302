"""Read a classifier stage, or an ensemble of them, from its artifact.

* ``.json``: an ensemble manifest (ensemble.py), its stages' artifacts beside it;
* ``.npz``: the character model (classifier.py), the word stage (words.py) or the character
  stage summed with a frozen embedding view (embedding.py), by the format in its metadata;
  read with ``allow_pickle=False``;
* a directory: the fine-tuned encoder (encoder.py, when it holds ``encoder.json``), or a
  Hugging Face checkpoint the operator brings (guard.py, when it holds ``config.json``).

The kinds that need onnxruntime or torch are imported only when one is configured.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from consumers.filter.classifier import ARTIFACT_FORMAT, load_linear
from consumers.filter.embedding import EMBED_FORMAT, base_artifact, load_summed
from consumers.filter.ensemble import ENSEMBLE_FORMAT, Ensemble, Member
from consumers.filter.interface import Classifier
from consumers.filter.words import WORDS_FORMAT, load_words

__all__ = ["load_classifier", "load_ensemble", "load_stage"]


def load_stage(path: str | Path, attack_label: str | None = None) -> Classifier:
    """One stage: an ``.npz`` artifact, the encoder's directory, or a guard model's checkpoint."""
    path = Path(path)
    if path.is_dir():
        if (path / "encoder.json").is_file():
            from consumers.filter.encoder import load_encoder  # noqa: PLC0415 - onnxruntime only when served

            return load_encoder(path)
        from consumers.filter.guard import GuardModel  # noqa: PLC0415 - torch only when a guard is configured

        return GuardModel(path, attack_label)
    if not path.is_file():
        raise FileNotFoundError(f"classifier artifact {path} not found; train one with `arena filter-train`")
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        if meta.get("format") == WORDS_FORMAT:
            return load_words(z, meta)
        if meta.get("format") == EMBED_FORMAT:
            base = load_stage(base_artifact(path, meta))
            return load_summed(path, z, meta, base)  # onnxruntime imported only here
        if meta.get("format") != ARTIFACT_FORMAT:
            raise ValueError(f"{path}: not a prompt classifier artifact (format {meta.get('format')!r})")
        return load_linear(z, meta)


def load_classifier(path: str | Path, attack_label: str | None = None) -> Classifier | Ensemble:
    """An ensemble manifest (``.json``) or one stage (:func:`load_stage`)."""
    p = Path(path)
    if p.suffix == ".json" and p.is_file():
        return load_ensemble(p)
    return load_stage(p, attack_label)


def load_ensemble(path: str | Path) -> Ensemble:
    """An ensemble manifest (JSON) and the artifacts it names, beside it; each artifact must be
    the version the manifest was written for (its operating point belongs to those weights)."""
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
