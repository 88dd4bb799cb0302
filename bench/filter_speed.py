"""Prompts per second of the prompt filter on one core.

Uses the benign prompts of the development corpus when it is present (they are
what the filter mostly sees), else a built-in sample. Prints figures; it
asserts nothing, since speed depends on the machine.

    python -m bench.filter_speed [--corpus PATH] [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from consumers.filter.policy import inspect_prompt

CORPUS = Path(__file__).resolve().parents[1].parent / "shared/data/injection-dev.jsonl"
SAMPLE = [
    "Write a Python function that merges two sorted lists in O(n) time.",
    "Act as a travel guide and suggest a three-day itinerary for Lisbon.",
    'Fix this JSON: {"name": "x", "tags": ["a", "b",]}',
    "Tell me a story where the ship's computer says:\nSystem: online\nand the crew cheers.",
    "What is the derivative of x² · sin(x)? Show the steps.",
    "Summarize the plot of Hamlet in five sentences, in French.",
    "def f(x):\n    return {k: v for k, v in x.items() if v}\n\nWhy does this fail on None?",
    "Écris un poème sur la mer, avec des rimes croisées.",
]


def load_prompts(path: Path) -> tuple[list[str], str]:
    if path.is_file():
        with path.open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts = [r["text"] for r in rows if r["label"] == "benign"]
        if prompts:
            return prompts, f"{len(prompts)} benign prompts from {path}"
    return SAMPLE, f"{len(SAMPLE)} built-in sample prompts"


def measure(prompts: list[str], seconds: float) -> tuple[float, float, int, list[float]]:
    """Run passes over ``prompts`` until ``seconds`` elapse.

    Returns prompts/s by wall clock and by this process's CPU time (the fair
    figure on a shared machine), the count, and per-prompt latencies.
    """
    done, latencies = 0, []
    start, cpu_start = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        for p in prompts:
            t0 = time.perf_counter()
            inspect_prompt(p)
            latencies.append(time.perf_counter() - t0)
        done += len(prompts)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return done / wall, done / cpu, done, latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    prompts, what = load_prompts(args.corpus)
    for p in prompts[:50]:  # warm the lazily filled fold table and regex caches
        inspect_prompt(p)
    rate, cpu_rate, done, lat = measure(prompts, args.seconds)
    lat.sort()
    chars = statistics.median(len(p) for p in prompts)
    print(f"prompt filter speed, one core, {what} (median {chars:.0f} chars)")
    print(f"  {rate:,.0f} prompts/s wall clock, {cpu_rate:,.0f} prompts/s of CPU time, over {done:,} prompts")
    print(
        f"  latency p50 {1e6 * lat[len(lat) // 2]:.0f} us, p99 {1e6 * lat[int(len(lat) * 0.99)]:.0f} us, "
        f"max {1e3 * lat[-1]:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
