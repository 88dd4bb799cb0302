"""What a frozen sentence-embedding view adds to the character stage, attack families held out.

Issue 33's outside comparison found that views which are not alike add up. This measures it on
the protocol of its target (heldout.loso_attack_scores: each attack family scored by a model that
never saw it, the threshold at 0.3% of a held-out benign fold), fitting inside every fold:

* ``chars``: the character stage as shipped (train.py: n-grams, cues, memory);
* ``embed``: all-MiniLM-L6-v2 as pretrained (not fine-tuned), as the served view reads it
  (consumers/filter/embedding.py: one 128-token window mean-pooled, a long prompt's first and
  last 63 tokens; int8 ONNX Runtime), standardized, then a logistic regression (C=0.1) with the same
  family-balanced weights;
* ``chars + a*embed``: the two logits summed, each centred and scaled by the median and spread of
  its own scores on the fold's benign training rows (how train.fit_views sums its views).

The embeddings of every row are cached (``--cache``, 8 min to make on the 2-core machines here).

    python -m lab.filter.embed_view [--mix 0.25,0.5,0.75,1] [--cache PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from consumers.filter.embedding import WINDOW, FrozenEmbedder, model_path
from lab.filter import heldout, train
from lab.filter.corpus import load_rows
from lab.filter.train_embed import EMBED_C, Joint, Views, build_model, embed_rows, fit_views

DEFAULT_CACHE = Path.home() / f".cache/arenaflow/filter-embed-view-{WINDOW}.npy"  # the window read


def fitters(mixes: list[float], c: float = EMBED_C) -> dict[str, heldout.Fit]:
    """One fit per column: chars, embed, and chars + a * embed for each ``a``. A fold's two views
    are fitted once (train_embed.fit_views), for its first column (the folds are the same for
    every column, so the fold is known by its labels and weights)."""
    cache: dict[bytes, Views] = {}

    def views(x: Joint, y: np.ndarray, w: np.ndarray) -> Views:
        key = hashlib.sha256(y.tobytes() + w.tobytes()).digest()
        if key not in cache:
            cache[key] = fit_views(x, y, w, c)
        return cache[key]

    def column(score: Callable[[Views, Joint], np.ndarray]) -> heldout.Fit:
        def fit(x: Joint, y: np.ndarray, w: np.ndarray) -> Callable[[Joint], np.ndarray]:
            fold = views(x, y, w)
            return lambda held: score(fold, held)

        return fit

    def summed(mix: float) -> heldout.Fit:
        return column(lambda v, held: v.summed(held, mix))

    return {
        "chars": column(lambda v, held: v.chars(held.chars)),
        "embed": column(Views.embed),
        **{f"chars+{m:g}*embed": summed(m) for m in mixes},
    }


def embeddings(rows, cache: Path) -> np.ndarray:
    """Each row's embedding as the served view reads it (consumers/filter/embedding.py); cached by
    the rows' count."""
    if cache.is_file():
        e = np.load(cache)
        if len(e) == len(rows):
            print(f"embeddings from {cache}")
            return e
    embedder = FrozenEmbedder(model_path(build_model()), threads=2)
    e = embed_rows(embedder, [r.text for r in rows], print)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, e)
    return e


def print_columns(tables: dict[str, tuple[dict, float]]) -> None:
    """A markdown table of held-out tables side by side (heldout.table's, each with its held-out
    benign share): catch per attack family, the mean, benign flagged; the first column's families."""
    names = list(tables)
    print(f"\n| attack family held out | n | {' | '.join(names)} |\n|---|---|{'---|' * len(names)}")
    for f, v in tables[names[0]][0]["families"].items():
        if v["caught"] is not None:
            cells = " | ".join(f"{100 * tables[k][0]['families'][f]['caught']:.1f}%" for k in names)
            print(f"| {f} | {v['attacks']:,} | {cells} |")
    means = " | ".join(f"**{100 * tables[k][0]['mean_catch']:.1f}%**" for k in names)
    print(f"| **mean** | | {means} |")
    print(f"| held-out benign flagged | | {' | '.join(f'{100 * tables[k][1]:.2f}%' for k in names)} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--mix", default="0.25,0.5,0.75,1", help="weights a of the embedding view in the sums")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the rows' embeddings (made when missing)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    rows, dev = load_rows(train.TRAIN_FILE), load_rows(train.DEV_FILE)
    fitted, y, fam, boost = train.training_set(rows, dev, True, train.DEV_WEIGHT)
    e = embeddings(fitted, args.cache)
    e = (e - e.mean(axis=0)) / (e.std(axis=0) + 1e-6)  # unsupervised: no label enters the scaling
    x = Joint(train.data(fitted, train.BITS, word_orders=()), e)
    columns = fitters([float(m) for m in args.mix.split(",")])
    tables = {}
    for name, fit in columns.items():
        att, ben = heldout.loso_attack_scores(x, y, fam, fit, "family", seed=0, boost=boost)
        t = heldout.threshold_at(ben, train.FP_CAP)
        tables[name] = (heldout.table(att, y, fam, t, float), float((ben >= t).mean()))
        print(f"  {name}: {100 * tables[name][0]['mean_catch']:.1f}% ({time.perf_counter() - start:.0f} s)", flush=True)
    print_columns(tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
