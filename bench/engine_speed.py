"""Tokens per second of the batch engine at several batch sizes, in both modes.

    python -m bench.engine_speed                       # stories260K
    python -m bench.engine_speed --model /path/to/hf-dir --device cuda --dtype bfloat16
    python -m bench.engine_speed --closed-loop --loads 1,32 --lengths 64 --json engine.json

All requests of a run are queued at once with distinct prompts of different lengths;
throughput counts completion tokens over the wall time from the first step to the last.

`--closed-loop` is the engine alone under the served benchmark's load instead: N
requests always in the engine (one joins as one ends) for `--duration` seconds, with
the benchmark workload's prompts (chat template) and lengths; `bench.compare` runs it
as its `engine` row, so served/engine is the share of the engine's speed that the
serving path keeps.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from bench.stats import summarize
from bench.workload import LengthMix, Workload, draw_session
from consumers.inference.engine import packed, prepack
from consumers.inference.engine.batch import BatchEngine, GenRequest
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.model_loading import LoadedModel, ModelSpec, default_specs, encode_prompt, load_model
from consumers.inference.runners import cores
from consumers.inference.settings import InferenceSettings

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


def prompt(i: int, repeat: int = 1) -> str:
    return " ".join([PROMPTS[i % len(PROMPTS)]] * repeat)


def run_once(
    loaded: LoadedModel,
    mode: Literal["static", "continuous"],
    batch: int,
    max_tokens: int,
    temperature: float,
    repeat: int = 1,
) -> tuple[int, float, float]:
    engine = BatchEngine(loaded, mode, max_batch_size=batch)
    tok = loaded.tokenizer
    for i in range(batch):
        params = SamplingParams(temperature=temperature, top_p=0.95, seed=i, max_tokens=max_tokens)
        engine.add(GenRequest(f"r{i}", tok(prompt(i, repeat)).input_ids, params))
    generated = 0
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_work():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    return generated, time.perf_counter() - t0, time.process_time() - c0


def run_hf_cb(
    loaded: LoadedModel, batch: int, max_tokens: int, temperature: float, repeat: int = 1
) -> tuple[int, float, float]:
    """The same requests through transformers' own continuous batching (`generate_batch`,
    paged attention), the backend `transformers serve --continuous-batching` runs."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    tok = loaded.tokenizer
    inputs = [tok(prompt(i, repeat)).input_ids for i in range(batch)]
    longest = max(map(len, inputs)) + max_tokens
    cb = ContinuousBatchingConfig(
        page_size=128,
        num_blocks=max(8, batch * (-(-longest // 128)) + 4),
        max_batch_tokens=512,
        max_requests_per_batch=batch,
    )
    gen = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=temperature > 0,
        temperature=temperature or None,
        top_p=0.95 if temperature > 0 else None,
        eos_token_id=-1,  # every answer runs to max_tokens, as in the engine's runs (mostly)
        pad_token_id=loaded.tokenizer.pad_token_id or 0,
    )
    packed.disable(loaded.model)  # our engine switched it to its packing attention (SDPA otherwise)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = loaded.model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb, warmup=False)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return sum(len(o.generated_tokens) for o in outs.values()), secs, cpu


def closed_loop(
    loaded: LoadedModel, users: int, workload: Workload, duration_s: float, pack: bool | None = None
) -> dict:
    """`users` requests always in the continuous engine for `duration_s`; a level for the report.
    `pack`: steps with newcomers as one packed pass (None: the engine's default for the model)."""
    engine = BatchEngine(loaded, "continuous", max_batch_size=users, pack=pack)
    rng = random.Random(workload.seed)
    chat = [{"role": "user", "content": ""}]
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    records: list[dict] = []
    t0, c0 = time.perf_counter(), time.process_time()

    def add(i: int) -> None:
        turn = draw_session(workload, rng)[0]
        chat[0]["content"] = turn.user_message
        params = SamplingParams(temperature=0.0, seed=i, max_tokens=turn.max_tokens)
        engine.add(GenRequest(f"r{i}", encode_prompt(loaded, chat), params))
        started[f"r{i}"] = time.perf_counter() - t0

    sent = 0
    for _ in range(users):
        add(sent)
        sent += 1
    while engine.has_work():
        for out in engine.step():
            now = time.perf_counter() - t0
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
            if not out.finished:
                continue
            start = started.pop(out.request_id)
            records.append(
                {
                    "status": "ok" if out.finish_reason in ("stop", "length") else "error",
                    "start_s": start,
                    "latency_s": now - start,
                    "ttft_s": first.pop(out.request_id, now) - start,
                    "output_tokens": out.completion_tokens,
                }
            )
            if now < duration_s:
                add(sent)
                sent += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"load": float(users), "load_label": f"{users} users", "summary": summarize(records, wall), "cpu_s": cpu}


def closed_loop_main(args: argparse.Namespace) -> None:
    spec = ModelSpec(name="engine", path=args.model[0], dtype=args.dtype, device=args.device)
    loaded = load_model(spec)
    if args.threads and args.threads_alone:  # as the engine process sizes them, alone on the machine (cores.py)
        params = prepack.parameter_count(loaded.model)
        torch.set_num_threads(cores.alone_threads(args.threads, args.threads_alone, params, prepack.MIN_PARAMS))
    workload = Workload(model="engine", lengths=LengthMix.parse(args.lengths), seed=args.seed)
    closed_loop(loaded, 2, replace(workload, lengths=LengthMix(((4, 1.0),))), 0.0)  # warm-up
    pack = {"auto": None, "on": True, "off": False}[args.pack]
    levels = [closed_loop(loaded, int(load), workload, args.duration, pack) for load in args.loads.split(",")]
    for level in levels:
        s = level["summary"]
        per_cpu = s["output_tokens"] / level["cpu_s"]
        print(
            f"engine {level['load_label']:>10} {s['tokens_per_s']:>9.0f} tok/s {per_cpu:>7.0f} tok/cpu-s"
            f"  P50 {s['latency_p50']:.3f} s  TTFT P50 {s['ttft_p50']:.3f} s"
        )
    row = {
        "name": "engine",
        "status": "ok",
        "levels": levels,
        "params": sum(p.numel() for p in loaded.model.parameters()),
        "threads": torch.get_num_threads(),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(row))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", action="append", help="HF model dir (repeatable); default stories260K")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    parser.add_argument("--prompt-repeat", type=int, default=1, help="each prompt repeated N times (longer contexts)")
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
    parser.add_argument(
        "--threads-alone",
        type=int,
        default=0,
        help="closed loop: the threads an engine stepping alone takes under `arena up` "
        "(ARENA_TORCH_THREADS_ALONE); a model under 10M parameters keeps --threads, as served",
    )
    parser.add_argument(
        "--hf-cb", action="store_true", help="also transformers' continuous batching (generate_batch) at each batch"
    )
    parser.add_argument("--closed-loop", action="store_true", help="the served benchmark's load instead (see above)")
    parser.add_argument("--loads", default="1,32", help="closed loop: concurrent requests per level")
    parser.add_argument(
        "--pack",
        choices=["auto", "on", "off"],
        default="auto",
        help="closed loop: a step with newcomers as one packed pass (auto: from 10M parameters)",
    )
    parser.add_argument("--lengths", default="64", help="closed loop: max_tokens[:weight],...")
    parser.add_argument("--duration", type=float, default=20.0, help="closed loop: seconds per level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="closed loop: write the levels here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.closed_loop:
        args.model = args.model or [default_specs(InferenceSettings().models_dir)[0].path]
        closed_loop_main(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, device {args.device}")

    paths = args.model or [default_specs(InferenceSettings().models_dir)[0].path]
    # CPU seconds too: on a shared machine wall time mostly measures the neighbours, while
    # tokens per CPU second (all of this process's threads) is what the engine costs.
    print(f"{'model':<24} {'mode':<11} {'batch':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>9} {'tok/cpu-s':>9}")
    for path in paths:
        spec = ModelSpec(name=path.rstrip("/").rsplit("/", 1)[-1], path=path, dtype=args.dtype, device=args.device)
        loaded = load_model(spec)
        run_once(loaded, "continuous", 2, 4, args.temperature)  # warm-up
        for mode in args.modes:
            for batch in args.batches:
                n, secs, cpu = run_once(loaded, mode, batch, args.max_tokens, args.temperature, args.prompt_repeat)
                print(
                    f"{spec.name:<24} {mode:<11} {batch:>5} {n:>7} {secs:>8.2f} {n / secs:>9.0f} {n / cpu:>9.0f}",
                    flush=True,
                )
        if args.hf_cb:
            run_hf_cb(loaded, 2, 4, args.temperature)  # warm-up
            for batch in args.batches:
                n, secs, cpu = run_hf_cb(loaded, batch, args.max_tokens, args.temperature, args.prompt_repeat)
                print(
                    f"{spec.name:<24} {'hf-cb':<11} {batch:>5} {n:>7} {secs:>8.2f} {n / secs:>9.0f} {n / cpu:>9.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
