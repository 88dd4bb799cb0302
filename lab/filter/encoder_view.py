"""What the fine-tuned encoder adds to the character stage, attack families held out, fine-tuned per fold.

The shipped encoder (train_encoder.py) is measured on one held-out third of the attack families,
because fine-tuning once per family did not fit the slower machines. This runs the protocol of
issue 33's target itself (heldout.attack_folds, loso_attack_scores' folds: attack family ``i`` held out with
benign fold ``i mod 5``, the threshold at 0.3% of that benign fold, pooled): in every fold the
encoder is fine-tuned from all-MiniLM-L6-v2 on the fold's training rows with the character
stage's family-balanced weights (train_encoder.fine_tune, the shipped options), exported as
served (int8 ONNX Runtime, every window of a long prompt, the highest logit), and scored on the
fold's held-out rows. Columns:

* ``chars``: the character stage as shipped (train.py: n-grams, cues, memory);
* ``encoder``: the fine-tuned encoder alone;
* ``chars + a*encoder``: the two logits summed, each centred and scaled by the median and spread
  of its scores on benign training rows of the fold (a seeded sample of ``--scale-rows``; the
  character stage's own scaling is on all of them), as train_embed.fit_views sums its views;
* ``chars OR encoder``: the larger of the two scaled logits' margins over their own thresholds at
  half the cap of the fold's held-out benign rows, thresholded like the other columns.

Each fold's encoder scores are cached (``--cache``), so a run that stops resumes where it stopped;
a fold takes 3-4 minutes on a 2-core AVX-512 machine (20 folds).

    python -m lab.filter.encoder_view [--mix 0.25,0.5,1] [--cache DIR] [--steps 120]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from lab.filter import heldout, train
from lab.filter.corpus import load_rows
from lab.filter.embed_view import print_columns
from lab.filter.train_embed import CHARS_FIT, scale
from lab.filter.train_encoder import EncoderOptions, export, fine_tune, provisional, score_rows

DEFAULT_CACHE = Path.home() / ".cache/arenaflow/filter-encoder-view"


def fold_scores(
    rows,
    i: int,
    train_rows: np.ndarray,
    weights: np.ndarray,
    held: np.ndarray,
    scale_rows: np.ndarray,
    options: EncoderOptions,
    cache: Path,
) -> np.ndarray:
    """The fold's encoder, fine-tuned on ``train_rows`` drawn with ``weights``: its logits on ``held``
    then ``scale_rows`` (cached by fold)."""
    path = cache / f"fold-{i:02d}-steps{options.steps}-seed{options.seed}.npz"
    wanted = np.concatenate([held, scale_rows])
    if path.is_file():
        saved = np.load(path)
        if np.array_equal(saved["rows"], wanted):
            return saved["logits"]
    model, tokenizer = fine_tune([rows[j] for j in train_rows], weights, options, log=lambda s: None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        export(model, tokenizer, out, log=lambda s: None)
        provisional(out, tokenizer, options)
        logits = score_rows(out, [rows[j].text for j in wanted], log=lambda s: None)
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(path, rows=wanted, logits=logits)
    return logits


def report(attack: dict[str, np.ndarray], benign: dict[str, list[np.ndarray]], y, fam):
    """The table: each column at the threshold flagging 0.3% of its held-out benign scores, pooled."""
    tables: dict[str, tuple[dict, float]] = {}
    for n, scores in attack.items():
        ben = np.concatenate(benign[n])
        t = heldout.threshold_at(ben, train.FP_CAP)
        tables[n] = (heldout.table(scores, y, fam, t, float), float((ben >= t).mean()))
    print_columns(tables)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--mix", default="0.25,0.5,1", help="weights a of the encoder in the sums")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="each fold's encoder scores")
    p.add_argument("--steps", type=int, default=EncoderOptions.steps, help="fine-tuning steps per fold")
    p.add_argument("--scale-rows", type=int, default=200, help="benign training rows scoring the encoder's scale")
    args = p.parse_args(argv)
    options = EncoderOptions(steps=args.steps)
    mixes = [float(m) for m in args.mix.split(",")]
    start = time.perf_counter()
    rows, dev = load_rows(train.TRAIN_FILE), load_rows(train.DEV_FILE)
    fitted, y, fam, boost = train.training_set(rows, dev, True, train.DEV_WEIGHT)
    x = train.data(fitted, train.BITS, word_orders=())
    rng = np.random.default_rng(0)
    names = ["chars", "encoder", *(f"chars+{m:g}*encoder" for m in mixes), "chars OR encoder"]
    attack = {n: np.full(len(y), np.nan) for n in names}
    benign: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for i, (f, held_attack, held_benign) in enumerate(heldout.attack_folds(y, fam)):
        train_rows = np.flatnonzero(~held_attack & ~held_benign)
        held = np.flatnonzero(held_attack | held_benign)
        benign_train = train_rows[~y[train_rows]]
        scale_rows = np.sort(rng.choice(benign_train, min(args.scale_rows, len(benign_train)), replace=False))
        w = heldout.family_weights(y[train_rows], fam[train_rows], "family", boost)
        z = fold_scores(fitted, i, train_rows, w, held, scale_rows, options, args.cache)
        enc, enc_scale = z[: len(held)], scale(z[len(held) :])
        chars = CHARS_FIT(x[train_rows], y[train_rows], w)
        c_held, c_scale = chars(x[held]), scale(chars(x[benign_train]))
        cs, es = (c_held - c_scale[0]) / c_scale[1], (enc - enc_scale[0]) / enc_scale[1]
        is_attack = y[held]
        # OR at half the cap each: the larger of the two margins over each one's threshold in the fold
        tc = heldout.threshold_at(cs[~is_attack], train.FP_CAP / 2)
        te = heldout.threshold_at(es[~is_attack], train.FP_CAP / 2)
        columns = {
            "chars": c_held,
            "encoder": enc,
            **{f"chars+{m:g}*encoder": cs + m * es for m in mixes},
            "chars OR encoder": np.maximum(cs - tc, es - te),
        }
        for n, v in columns.items():
            attack[n][held[is_attack]] = v[is_attack]
            benign[n].append(v[~is_attack])
        t_c = heldout.threshold_at(c_held[~is_attack], train.FP_CAP)
        t_e = heldout.threshold_at(enc[~is_attack], train.FP_CAP)
        print(
            f"  fold {i + 1}/20 {f}: chars {np.mean(c_held[is_attack] >= t_c):.2f},"
            f" encoder {np.mean(enc[is_attack] >= t_e):.2f} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    report(attack, benign, y, fam)
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
