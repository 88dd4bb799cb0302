"""`arena filter-train`'s ensemble: the word stage beside the character stage, their operating points.

Both stages fit the same rows with the same sample weights (train.training_set) and run
the same protocols on the same folds, so their held-out scores line up row by row. The
ensemble is then measured from those scores (protocols.tables over both stages) without
training anything again, and its operating points are chosen on the benign references
alone (ensemble.operating_points: the leave-one-source-out logits of the benign rows).
The manifest written last names each stage's artifact and version; the filter loads the
ensemble from it (reloading it when it changes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.words import save_words
from lab.filter import protocols, train_words
from lab.filter.calibrate import operating_points, write_manifest
from lab.filter.corpus import Row
from lab.filter.train import Trained

__all__ = ["build"]


def build(
    chars: Trained,
    chars_path: Path,
    fitted: Sequence[Row],
    y: np.ndarray,
    families: np.ndarray,
    boost: dict[str, float] | None,
    *,
    words_path: Path,
    manifest_path: Path,
    dev: protocols.DevRows | None,
    dev_texts: Sequence[Row],
    word_options: dict[str, Any],
    evaluate_heldout: bool,
    fp_cap: float,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train the word stage, write its artifact, then the manifest of both stages; returns the manifest's
    summary (version, operating points, the ensemble's tables)."""
    log("word stage (TF-IDF + logistic regression), the same rows and protocols ...")
    words = train_words.train(
        fitted,
        y,
        families,
        boost,
        dev=dev,
        dev_texts=dev_texts,
        evaluate_heldout=evaluate_heldout,
        fp_cap=fp_cap,
        log=log,
        **word_options,
    )
    m = words.model
    save_words(words_path, m.weights, m.bias, m.df, words.meta, words.reference)
    assert chars.reference is not None
    references = {"chars": chars.reference, "words": words.reference}
    points = operating_points(references, fp_cap)
    report: dict[str, Any] = {
        "fp_cap": fp_cap,
        "calibration": "each stage: share of its leave-one-source-out benign logits below the prompt's",
        "reference_rows": len(words.reference),
        "threshold_from": "loso" if evaluate_heldout else "in-sample",
    }
    if chars.heldout is not None and words.heldout is not None:
        tables, _ = protocols.tables([chars.heldout, words.heldout], y, families, fp_cap, dev)
        report.update(tables)
    stages = [
        {"name": "chars", "artifact": _relative(chars_path, manifest_path), "version": chars.meta["version"]},
        {"name": "words", "artifact": _relative(words_path, manifest_path), "version": words.meta["version"]},
    ]
    version = write_manifest(manifest_path, stages, points, report)
    return {"version": version, "words": words.meta["version"], "points": points, "report": report}


def _relative(artifact: Path, manifest: Path) -> str:
    return os.path.relpath(artifact.resolve(), manifest.resolve().parent)
