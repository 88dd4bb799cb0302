"""Tokens per second of the batch engine at several batch sizes, in both modes.

    python -m bench.engine_speed                       # stories260K
    python -m bench.engine_speed --model /path/to/hf-dir --device cuda --dtype bfloat16

All requests of a run are queued at once with distinct prompts of different lengths;
throughput counts completion tokens over the wall time from the first step to the last.
"""

from __future__ import annotations

import argparse
import time
from typing import Literal

import torch

from consumers.inference.engine import BatchEngine, GenRequest
from consumers.inference.models import LoadedModel, ModelSpec, default_specs, load_model
from consumers.inference.sampling import SamplingParams
from runtime.settings import InferenceSettings

PROMPTS = [
    "Once upon a time",
    "Lily had a red ball. She",
    "The big dog ran to the park and saw a bird in the tall green tree. The dog",
    "Tom wanted to",
    "One day, a little boy named Ben went to the beach with his mom and dad.",
    "Sara liked to",
    "There was a cat who",
    "The sun was shining and the birds were singing. Anna wanted to go outside, but",
]


def run_once(
    loaded: LoadedModel, mode: Literal["static", "continuous"], batch: int, max_tokens: int, temperature: float
) -> tuple[int, float]:
    engine = BatchEngine(loaded, mode, max_batch_size=batch)
    tok = loaded.tokenizer
    for i in range(batch):
        params = SamplingParams(temperature=temperature, top_p=0.95, seed=i, max_tokens=max_tokens)
        engine.add(GenRequest(f"r{i}", tok(PROMPTS[i % len(PROMPTS)]).input_ids, params))
    generated = 0
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_work():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    return generated, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="HF model dir (repeatable); default stories260K")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--modes", nargs="+", default=["static", "continuous"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads; tiny models run fastest with 1, "
        "and on a busy machine extra OpenMP threads mostly spin",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, device {args.device}")

    paths = args.model or [default_specs(InferenceSettings().models_dir)[0].path]
    print(f"{'model':<24} {'mode':<11} {'batch':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>9}")
    for path in paths:
        spec = ModelSpec(name=path.rstrip("/").rsplit("/", 1)[-1], path=path, dtype=args.dtype, device=args.device)
        loaded = load_model(spec)
        run_once(loaded, "continuous", 2, 4, args.temperature)  # warm-up
        for mode in args.modes:
            for batch in args.batches:
                n, secs = run_once(loaded, mode, batch, args.max_tokens, args.temperature)
                print(f"{spec.name:<24} {mode:<11} {batch:>5} {n:>7} {secs:>8.2f} {n / secs:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
