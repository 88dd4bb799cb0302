"""What fine-tuning buys: frozen all-MiniLM-L6-v2 embeddings + logistic regression on the encoder's rows.

The same split as the shipped encoder (train_encoder.holdout: a third of the attack families never
trained on, a fifth of every other family and label); the embeddings are the pretrained model's,
mean-pooled over each window and averaged over a prompt's windows, computed with ONNX Runtime
(int8, as the stage serves); the regression (scikit-learn, C=1) fits ``--fit`` training rows drawn
with the family-balanced weights. Threshold at 0.3% of the held-out benign rows, as
encoder_heldout.py reads the fine-tuned stage.

    python -m lab.filter.frozen_baseline [--encoder DIR] [--fit 4000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from consumers.filter.classifier import DEFAULT_ARTIFACT
from consumers.filter.encoder import windows
from consumers.filter.loader import load_stage
from lab.filter import heldout
from lab.filter.corpus import load_rows
from lab.filter.encoder_heldout import summary
from lab.filter.train import DEV_FILE, TRAIN_FILE
from lab.filter.train_encoder import EncoderOptions, base_model_dir, holdout, onnx_export


def export_frozen(out: Path) -> Path:
    """The pretrained encoder, mean-pooled per window, exported to ONNX with int8 weights: ``out/int8.onnx``."""
    import torch  # noqa: PLC0415
    from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: PLC0415
    from transformers import AutoModel  # noqa: PLC0415

    base = base_model_dir()
    model = AutoModel.from_pretrained(base, local_files_only=True).eval()

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = model  # registered: the exporter traces the parameters of the module it is given

        def forward(self, input_ids, attention_mask):
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)

    onnx_export(Pooled(), out / "fp32.onnx", "embedding")
    quantize_dynamic(str(out / "fp32.onnx"), str(out / "int8.onnx"), weight_type=QuantType.QInt8)
    return out / "int8.onnx"


def embedder(out: Path):
    """The pretrained encoder, mean-pooled, as an int8 ONNX Runtime session; and its tokenizer."""
    import onnxruntime as ort  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    model = export_frozen(out)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    return session, AutoTokenizer.from_pretrained(base_model_dir(), local_files_only=True)


def embed(session, tokenizer, texts: list[str], size: int = 128) -> np.ndarray:
    out = np.zeros((len(texts), 384), dtype=np.float32)
    start = time.perf_counter()
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ws = [[tokenizer.cls_token_id, *w, tokenizer.sep_token_id] for w in windows(ids, size - 2, 32)]
        width = max(map(len, ws))
        a = np.zeros((len(ws), width), dtype=np.int64)
        m = np.zeros_like(a)
        for r, w in enumerate(ws):
            a[r, : len(w)], m[r, : len(w)] = w, 1
        (e,) = session.run(None, {"input_ids": a, "attention_mask": m})
        out[i] = np.asarray(e).mean(axis=0)
        if i % 1000 == 999:
            print(f"  embedded {i + 1}/{len(texts)}, {time.perf_counter() - start:.0f} s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--encoder", type=Path, default=DEFAULT_ARTIFACT.with_name("prompt-encoder"))
    p.add_argument("--fit", type=int, default=4000, help="training rows the regression fits (family-balanced draw)")
    args = p.parse_args(argv)
    meta = load_stage(args.encoder).meta  # type: ignore[attr-defined]
    options = EncoderOptions(**meta["report"]["options"])
    rows = [*load_rows(TRAIN_FILE), *load_rows(DEV_FILE)]
    held, unseen = holdout(rows, options)
    y = np.array([r.attack for r in rows])
    fam = np.array([r.family for r in rows])
    fit_idx = np.flatnonzero(~held)
    w = heldout.family_weights(y[fit_idx], fam[fit_idx])
    rng = np.random.default_rng(options.seed)
    chosen = np.unique(rng.choice(fit_idx, args.fit, p=w / w.sum()))
    with tempfile.TemporaryDirectory() as tmp:
        session, tokenizer = embedder(Path(tmp))
        x_fit = embed(session, tokenizer, [rows[i].text for i in chosen])
        held_idx = np.flatnonzero(held)
        x_held = embed(session, tokenizer, [rows[i].text for i in held_idx])
    sw = heldout.family_weights(y[chosen], fam[chosen])
    clf = LogisticRegression(C=1.0, max_iter=2000).fit(x_fit, y[chosen], sample_weight=sw)
    z = clf.decision_function(x_held)
    hy, hf = y[held_idx], fam[held_idx]
    flag = z >= heldout.threshold_at(z[~hy], 0.003)
    never, seen = summary(flag, hy, hf, unseen), summary(flag, hy, hf, set(hf[hy]) - unseen)
    for f, v in never["families"].items():
        print(f"  {f:<50} {100 * v:6.1f}%")
    print(
        f"frozen MiniLM + LR ({len(chosen)} training rows): families never seen {100 * never['mean_catch']:.1f}%,"
        f" a fifth of the others {100 * seen['mean_catch']:.1f}%, held-out benign flagged {100 * never['fp']:.2f}%"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
