"""The ceiling: batched `model.generate` in one process, no serving at all.

    python -m bench.ceiling --model .arena/models/llama-60m --requests 32 --batch-sizes 1,4,8,16

Runs the workload's requests (single-turn, same prompts and `max_tokens` as the served
runs) in batches of each size, best case: requests sorted by `max_tokens` so a batch
wastes few steps, all of them present at time 0, no HTTP, no queue. A request's
latency is its batch's generate time; its TTFT the batch's first step. Only the tokens
a request asked for count toward throughput.

`--compute N` also times the first N requests one at a time (batch 1): the model's own
compute for each, which `bench.overhead` subtracts from served latencies.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import hf
from bench.stats import summarize
from bench.workload import LengthMix, Turn, Workload, fixed_requests


def _prompts(lm: hf.LoadedModel, turns: list[Turn]) -> list[str]:
    return [hf.render(lm.tokenizer, [{"role": "user", "content": t.user_message}]) for t in turns]


def run_batch_size(lm: hf.LoadedModel, turns: list[Turn], batch_size: int) -> dict:
    """One ceiling level: every request, in length-sorted batches of `batch_size`."""
    order = sorted(range(len(turns)), key=lambda i: turns[i].max_tokens)
    prompts = _prompts(lm, turns)
    records, clock = [], 0.0
    for first in range(0, len(order), batch_size):
        chunk = order[first : first + batch_size]
        steps = max(turns[i].max_tokens for i in chunk)
        timer = hf.TokenTimer()
        timer.started = time.perf_counter()
        hf.generate(lm, hf.encode(lm, [prompts[i] for i in chunk]), steps, streamer=timer)
        took = time.perf_counter() - timer.started
        for i in chunk:
            records.append(
                {
                    "session": i,
                    "turn": 0,
                    "max_tokens": turns[i].max_tokens,
                    "start_s": clock,
                    "status": "ok",
                    "http_status": None,
                    "latency_s": took,
                    "ttft_s": timer.first_token_s,
                    "output_tokens": turns[i].max_tokens,
                    "tokens_from": "usage",
                    "error": None,
                    "timings": None,
                }
            )
        clock += took
    return {
        "load": float(batch_size),
        "load_label": f"batch {batch_size}",
        "mode": "batch",
        "summary": summarize(records, clock),
        "records": records,
    }


def compute_times(lm: hf.LoadedModel, turns: list[Turn]) -> list[dict]:
    """Batch-1 generate time (and first-step time) of each request, in order."""
    out = []
    for prompt, turn in zip(_prompts(lm, turns), turns, strict=True):
        timer = hf.TokenTimer()
        timer.started = time.perf_counter()
        hf.generate(lm, hf.encode(lm, [prompt]), turn.max_tokens, streamer=timer)
        out.append(
            {
                "max_tokens": turn.max_tokens,
                "compute_s": time.perf_counter() - timer.started,
                "first_token_s": timer.first_token_s,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--requests", type=int, default=32, help="requests per batch size")
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--lengths", default="16:0.8,128:0.2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compute", type=int, default=0, help="also time the first N requests at batch 1")
    parser.add_argument("--out", type=Path, help="JSON file (default: print)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)

    lm = hf.load(args.model, dtype=args.dtype)
    workload = Workload(model=lm.name, lengths=LengthMix.parse(args.lengths), seed=args.seed)
    turns = fixed_requests(workload, max(args.requests, args.compute))
    hf.generate(lm, hf.encode(lm, _prompts(lm, turns[:2])), 4)  # warm-up
    levels = [run_batch_size(lm, turns[: args.requests], int(b)) for b in args.batch_sizes.split(",")]
    result = {
        "name": "ceiling",
        "status": "ok",
        "params": lm.params,
        "levels": levels,
        "compute": compute_times(lm, turns[: args.compute]),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for level in levels:
        s = level["summary"]
        print(f"ceiling {level['load_label']}: {s['requests_per_s']:.2f} req/s, {s['tokens_per_s']:.0f} tok/s")
    if not args.out:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
