"""Which runtime serves the filter's encoder stage fastest on this CPU: torch (float32, dynamic int8)
or ONNX Runtime (float32, dynamic int8), on the same windows, one thread.

The model is all-MiniLM-L6-v2 with the stage's head (mean pooling, one logit); its weights do not
change its speed, so the pretrained checkpoint stands in for the fine-tuned one. Prompts: the
benign prompts of the development corpus, tokenized as the stage does (128-token windows).
Per runtime: thread CPU time per prompt at batch 1 and at batch 4 (the filter's 4 workers
gathered), and the largest logit difference from torch float32. Prints figures, asserts nothing.

    python -m bench.encoder_runtime [--prompts 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from consumers.filter.encoder import windows
from lab.filter.train_encoder import _model, base_model_dir, onnx_export

CORPUS = Path(__file__).resolve().parents[1].parent / "shared/data/injection-dev.jsonl"


def _batches(ids: list[list[int]], size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for i in range(0, len(ids), size):
        part = ids[i : i + size]
        width = max(map(len, part))
        a = np.zeros((len(part), width), dtype=np.int64)
        m = np.zeros_like(a)
        for r, w in enumerate(part):
            a[r, : len(w)], m[r, : len(w)] = w, 1
        out.append((a, m))
    return out


def _cpu(run: Callable[[np.ndarray, np.ndarray], np.ndarray], batches) -> tuple[float, np.ndarray]:
    run(*batches[0])  # warm
    t0 = time.thread_time()
    z = np.concatenate([np.asarray(run(a, m)).reshape(-1) for a, m in batches])
    return time.thread_time() - t0, z


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = base_model_dir()
    tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
    with CORPUS.open(encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if '"benign"' in line][: args.prompts]
    ids = [
        [tok.cls_token_id, *w, tok.sep_token_id]
        for t in texts
        for w in windows(tok(t, add_special_tokens=False)["input_ids"], 126, 32)
    ]
    model = _model(base).eval()
    int8 = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    tmp = Path(tempfile.mkdtemp())
    onnx_export(model, tmp / "fp32.onnx", "logit")
    quantize_dynamic(str(tmp / "fp32.onnx"), str(tmp / "int8.onnx"), weight_type=QuantType.QInt8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1

    def session(name: str):
        s = ort.InferenceSession(str(tmp / name), options, providers=["CPUExecutionProvider"])
        return lambda a, m: s.run(None, {"input_ids": a, "attention_mask": m})[0]

    def torch_run(net):
        def run(a, m):
            with torch.inference_mode():
                return net(torch.from_numpy(a), torch.from_numpy(m)).numpy()

        return run

    runtimes = {
        "torch float32": torch_run(model),
        "torch dynamic int8": torch_run(int8),
        "onnxruntime float32": session("fp32.onnx"),
        "onnxruntime dynamic int8": session("int8.onnx"),
    }
    print(f"encoder runtimes, one thread, {len(texts)} benign dev prompts ({len(ids)} windows of <= 128 tokens)")
    reference = None
    for name, run in runtimes.items():
        cells = []
        for size in (1, 4):
            cpu, z = _cpu(run, _batches(ids, size))
            if reference is None:
                reference = z
            cells.append(f"batch {size}: {1e3 * cpu / len(texts):6.1f} ms CPU a prompt")
        diff = float(np.abs(z - reference).max())
        print(f"  {name:<26} {' | '.join(cells)} | largest logit difference from torch float32 {diff:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
