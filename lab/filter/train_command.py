"""`arena filter-train`: the character stage, the word stage and their ensemble's manifest,
from one command (the recipes are train.py's, train_words.py's and train_ensemble.py's);
``--encoder`` the encoder stage (train_encoder.py), ``--embed-view`` the character stage
summed with a frozen embedding view (train_embed.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from consumers.filter import words
from consumers.filter.classifier import DEFAULT_ARTIFACT, save_linear
from consumers.filter.features import WORD_ORDERS
from consumers.filter.memory import WEIGHT as MEMORY_WEIGHT
from lab.filter import train_words
from lab.filter.corpus import load_rows
from lab.filter.train import (
    BITS,
    DEV_FILE,
    DEV_WEIGHT,
    FP_CAP,
    TRAIN_FILE,
    TRAIN_ON_DEV,
    C,
    dev_rows,
    rules_flag,
    train,
    training_set,
)
from lab.filter.train_ensemble import build

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``arena filter-train [--train FILE] [--dev FILE] [--[no-]train-on-dev] [--out PATH] [--seed N] [--limit N]
    [--no-eval] [--no-word-stage]``: the character stage, the word stage and their ensemble's manifest."""
    args = _parser().parse_args(argv)
    # beside the character stage unless told: a run with --out elsewhere leaves the committed artifacts alone
    args.words_out = args.words_out or str(Path(args.out).with_name("prompt-words.npz"))
    args.ensemble_out = args.ensemble_out or str(Path(args.out).with_name("ensemble.json"))
    try:
        rows = load_rows(args.train, args.limit)
        wanted = args.train_on_dev or not args.no_eval
        dev = load_rows(args.dev, args.limit) if args.dev and Path(args.dev).is_file() and wanted else []
    except (OSError, ValueError, KeyError) as exc:
        print(f"filter-train: cannot read the corpus: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.encoder:
        return _encoder(args, [*rows, *dev] if args.train_on_dev else rows)
    if args.embed_model or args.embed_view:
        return _embed(args, rows, dev)
    rules = rules_flag(dev) if dev else None
    log(f"character stage (n-grams, cues, memory) on {len(rows)} + {len(dev)} rows ...")
    chars = train(
        rows,
        bits=args.bits,
        c=args.c,
        seed=args.seed,
        balance=args.balance,
        word_orders=WORD_ORDERS if args.words else (),
        cues=not args.no_cues,
        evaluate_heldout=not args.no_eval,
        dev=dev,
        train_on_dev=args.train_on_dev,
        dev_weight=args.dev_weight,
        memory_weight=args.memory_weight,
        rules=rules,
    )
    save_linear(args.out, chars.weights, chars.bias, chars.meta, chars.memory, chars.reference)
    _wrote(args.out, chars.meta)
    if not args.no_word_stage:
        fitted, y, fam, boost = training_set(rows, dev, args.train_on_dev, args.dev_weight)
        dev_file = dev_rows(dev, None, args.train_on_dev, rules) if dev else None
        built = build(
            chars,
            Path(args.out),
            fitted,
            y,
            fam,
            boost,
            words_path=Path(args.words_out),
            manifest_path=Path(args.ensemble_out),
            dev=dev_file,
            dev_texts=dev,
            word_options={
                "orders": _orders(args.word_orders),
                "bits": args.word_bits,
                "c": args.word_c,
                "seed": args.seed,
            },
            evaluate_heldout=not args.no_eval,
            fp_cap=FP_CAP,
        )
        print(f"wrote {args.words_out}, version {built['words']}")
        both = next(p for p in built["points"] if len(p["enforced"]) == 2)
        print(
            f"wrote {args.ensemble_out}, version {built['version']}: both stages enforced at benign quantile"
            f" {both['quantile']:.5f}, thresholds " + ", ".join(f"{k} {v:.4f}" for k, v in both["thresholds"].items())
        )
    took = time.perf_counter() - start
    print(f"trained on {chars.meta['report']['rows']} rows in {took:.0f} s; `arena filter-eval` prints the tables")
    return 0


def _encoder(args: argparse.Namespace, rows: list) -> int:
    """The encoder stage alone: fine-tuned, exported, calibrated, then written with the lexical stages
    into its own manifest (ensemble-encoder.json; ensemble.json and the lexical artifacts stay as they are)."""
    from lab.filter.calibrate import extend_manifest  # noqa: PLC0415
    from lab.filter.train_encoder import EncoderOptions, train_encoder  # noqa: PLC0415

    out = Path(args.encoder_out or Path(args.out).with_name("prompt-encoder"))
    options = EncoderOptions(
        steps=args.encoder_steps,
        batch=args.encoder_batch,
        max_tokens=args.encoder_tokens,
        seed=args.seed,
        threads=args.encoder_threads,
    )
    start = time.perf_counter()
    meta = train_encoder(rows, out, options, FP_CAP, log)
    split, unseen = meta["report"]["held_out_split"], meta["report"]["held_out_families"]
    print(
        f"wrote {out}, version {meta['version']}, threshold {meta['threshold']:.4f}; attack families never seen:"
        f" mean catch {100 * unseen['mean_catch']:.2f}%; a fifth of the others: {100 * split['mean_catch']:.2f}%;"
        f" held-out benign flagged {100 * split['fp']:.2f}%"
    )
    lexical = Path(args.ensemble_out)
    if lexical.is_file():  # the lexical stages' manifest stays as it is: the encoder's is another, beside it
        manifest = Path(args.encoder_ensemble_out or lexical.with_name("ensemble-encoder.json"))
        version = extend_manifest(lexical, manifest, "encoder", out, meta["version"], FP_CAP)
        print(f"wrote {manifest}, version {version}: the stages of {lexical} and the encoder")
    print(f"trained the encoder stage in {time.perf_counter() - start:.0f} s")
    return 0


def log(message: str) -> None:
    print(message, flush=True)


def _wrote(path: str, meta: dict[str, Any]) -> None:
    size = Path(path).stat().st_size
    print(f"wrote {path} ({size / 1e6:.2f} MB), version {meta['version']}, threshold {meta['threshold']:.4f}")


def _embed(args: argparse.Namespace, rows: list, dev: list) -> int:
    """The frozen embedding model (``--embed-model``), or the character stage summed with it."""
    from lab.filter.train_embed import build_model, train_embed  # noqa: PLC0415 - torch: only here

    start = time.perf_counter()
    if args.embed_model:
        build_model(log)
        return 0
    if not args.train_on_dev or not dev:
        print(
            "filter-train: --embed-view sums the shipped character stage, which trains on the dev file", file=sys.stderr
        )
        return 2
    out = Path(args.embed_out or Path(args.out).with_name("prompt-embed-sum.npz"))
    meta = train_embed(
        rows, dev, Path(args.out), out, rules=rules_flag(dev), evaluate_heldout=not args.no_eval, log=log
    )
    held = meta["report"].get("loso_attack")
    tail = f"; attack families held out: mean {100 * held['mean_catch']:.1f}%" if held else ""
    print(f"wrote {out}, version {meta['version']}, threshold {meta['threshold']:.4f}{tail}")
    print(f"trained in {time.perf_counter() - start:.0f} s; serve it with ARENA_FILTER__CLASSIFIER_PATH={out}")
    return 0


def _orders(text: str) -> tuple[int, ...]:
    lo, _, hi = text.partition("-")
    return tuple(range(int(lo), int(hi or lo) + 1))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="arena filter-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", default=str(TRAIN_FILE), help="labelled JSONL: {text, label, source}")
    p.add_argument("--dev", default=str(DEV_FILE), help="dev file: k-fold in distribution, per family ('' to skip)")
    p.add_argument(
        "--train-on-dev",
        action=argparse.BooleanOptionalAction,
        default=TRAIN_ON_DEV,
        help="fit the final model (and the held-out protocols) on the train and dev files",
    )
    p.add_argument(
        "--dev-weight", type=float, default=DEV_WEIGHT, help="weight of a dev family relative to a train family"
    )
    p.add_argument("--out", default=str(DEFAULT_ARTIFACT), help="character stage artifact path (.npz)")
    p.add_argument("--words-out", default=None, help="word stage artifact (default: prompt-words.npz beside --out)")
    p.add_argument("--ensemble-out", default=None, help="the ensemble's manifest (default: ensemble.json beside --out)")
    p.add_argument("--no-word-stage", action="store_true", help="the character stage only (no word stage, no manifest)")
    p.add_argument("--word-orders", default="1-4", help="word n-gram orders of the word stage, e.g. 1-2 or 1-4")
    p.add_argument("--word-bits", type=int, default=words.BITS, help="log2 of the word stage's hashed space")
    p.add_argument("--word-C", type=float, default=train_words.C, dest="word_c", help="the word stage's C")
    p.add_argument(
        "--encoder",
        action="store_true",
        help="the encoder stage only: fine-tune all-MiniLM-L6-v2, export it (ONNX, int8), add it to the manifest",
    )
    p.add_argument("--encoder-out", default=None, help="the encoder's artifact directory (default: beside --out)")
    p.add_argument(
        "--encoder-ensemble-out",
        default=None,
        help="the lexical stages and the encoder (default: ensemble-encoder.json beside --ensemble-out)",
    )
    p.add_argument("--encoder-steps", type=int, default=120, help="fine-tuning steps of the encoder")
    p.add_argument("--encoder-batch", type=int, default=16, help="prompts (windows) per encoder step")
    p.add_argument("--encoder-tokens", type=int, default=128, help="tokens per window (long prompts: several)")
    p.add_argument("--encoder-threads", type=int, default=2, help="torch threads while fine-tuning")
    p.add_argument(
        "--embed-view",
        action="store_true",
        help="the character stage (--out) summed with a frozen all-MiniLM-L6-v2 view: prompt-embed-sum.npz",
    )
    p.add_argument("--embed-out", default=None, help="the summed stage's artifact (default: beside --out)")
    p.add_argument("--embed-model", action="store_true", help="only build the frozen embedding model into the cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=BITS, help="log2 of the hashed feature space")
    p.add_argument("--C", type=float, default=C, dest="c", help="inverse regularization strength")
    p.add_argument("--balance", choices=("family", "row"), default="family", help="class weights per family or per row")
    p.add_argument("--words", action="store_true", help="add the word 1-2-gram view to the character stage's sum")
    p.add_argument("--no-cues", action="store_true", help="without the hand-written cue view")
    p.add_argument(
        "--memory-weight",
        type=float,
        default=MEMORY_WEIGHT,
        help="logit added at full containment of a known training attack (0: no memory)",
    )
    p.add_argument("--limit", type=int, default=None, help="at most N rows per source family (quick runs)")
    p.add_argument("--no-eval", action="store_true", help="skip LOSO/k-fold; threshold from the training rows")
    return p


if __name__ == "__main__":
    raise SystemExit(main())
