"""Prompts per second of the prompt filter on one core: rules alone, then the whole filter,
then the cost of every cascade the filter can serve, side by side.

Uses the benign prompts of the development corpus when it is present (they are
what the filter mostly sees), else a built-in sample. The whole filter is rules
plus the classifier stage (the committed artifact, or --classifier). It also
reports the classifier's added latency on 4,000-character prompts.

The cascade table runs ``filter_request`` (what the filter process does with one
ChatRequested: rules, then every classifier stage, then the event) under each
configuration: the rules alone, the served default, and the ensemble manifest
(--ensemble) with its stages enforced or in shadow. Per configuration: CPU time per
prompt, and the added latency over the rules alone (interleaved per prompt, p50 and
p99, thread CPU time and wall clock), on the corpus prompts and on 4,000-character
ones. Prints figures; it asserts nothing, since speed depends on the machine.

The burst line runs many prompts at once through worker threads, as the filter process does, so the
encoder stage batches them: latency per prompt (queueing included) and CPU per prompt.

    python -m bench.filter_speed [--corpus PATH] [--seconds 3] [--classifier PATH] [--ensemble PATH] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from consumers.filter.app import filter_request
from consumers.filter.classifier import DEFAULT_ARTIFACT
from consumers.filter.config import FilterConfig
from consumers.filter.ensemble import Ensemble
from consumers.filter.loader import load_classifier
from consumers.filter.policy import inspect_prompt
from consumers.filter.sanitize import skeleton
from events.models import ChatRequested

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


def measure(
    prompts: list[str], seconds: float, run: Callable[[str], object] = inspect_prompt
) -> tuple[float, float, int, list[float]]:
    """Run passes over ``prompts`` until ``seconds`` elapse.

    Returns prompts/s by wall clock and by this process's CPU time (the fair
    figure on a shared machine), the count, and per-prompt latencies.
    """
    done, latencies = 0, []
    start, cpu_start = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        for p in prompts:
            t0 = time.perf_counter()
            run(p)
            latencies.append(time.perf_counter() - t0)
        done += len(prompts)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return done / wall, done / cpu, done, latencies


def _report(name: str, prompts: list[str], seconds: float, run: Callable[[str], object]) -> None:
    for p in prompts[:50]:  # warm the lazily filled fold table and regex caches
        run(p)
    rate, cpu_rate, done, lat = measure(prompts, seconds, run)
    lat.sort()
    print(f"  {name}: {rate:,.0f} prompts/s wall clock, {cpu_rate:,.0f} prompts/s of CPU time, over {done:,} prompts")
    print(
        f"    latency p50 {1e6 * lat[len(lat) // 2]:.0f} us, p99 {1e6 * lat[int(len(lat) * 0.99)]:.0f} us, "
        f"max {1e3 * lat[-1]:.1f} ms"
    )


def long_prompts(prompts: list[str], chars: int = 4000, count: int = 200) -> list[str]:
    """Distinct prompts of exactly ``chars`` characters, cut from the corpus joined end to end."""
    text = "\n".join(prompts)
    while len(text) < chars * count:
        text += "\n" + text
    return [text[i * chars : (i + 1) * chars] for i in range(count)]


def added_latency(
    prompts: list[str], run_rules, run_all, rounds: int = 5, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """p50 and p99 (seconds) of whole-filter minus rules-only time, per prompt, interleaved.

    With ``clock=time.thread_time`` the figure is this thread's CPU time: what the
    filter costs, without the waits a loaded machine's scheduler adds to wall clock.
    """
    added = []
    for _ in range(rounds):
        for p in prompts:
            skeleton.cache_clear()  # each call meets the prompt new, as the filter does: the rules' fold
            t0 = clock()  # of it is cached for the stages inside one call, not from the call before
            run_rules(p)
            t1 = clock()
            skeleton.cache_clear()
            t2 = clock()
            run_all(p)
            added.append((clock() - t2) - (t1 - t0))
    added.sort()
    return added[len(added) // 2], added[int(len(added) * 0.99)]


def _event(prompt: str) -> ChatRequested:
    """A chat as the filter receives it: the operator's system prompt, then the user's."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    return ChatRequested.model_validate(
        {"request_id": "b", "conv_id": "b", "model": "m", "messages": messages, "params": {}, "deadline_at": 2e9}
    )


def cascades(default, ensemble: Ensemble | None, summed=None) -> list[tuple[str, FilterConfig, object]]:
    """(name, config, classifier) of every configuration the cascade table compares (``summed``: the
    character stage summed with the frozen embedding view, consumers/filter/embedding.py)."""
    out: list[tuple[str, FilterConfig, object]] = [("rules only", FilterConfig(classifier_path=None), None)]
    out.append((f"served default ({default.version})", FilterConfig(), default))
    if summed is not None:
        out.append((f"chars + frozen embedding, summed ({summed.version})", FilterConfig(), summed))
    if ensemble is not None:
        names = ensemble.names
        out.append(
            (" + ".join(names) + ", all enforced", FilterConfig(stage_modes=dict.fromkeys(names, "block")), ensemble)
        )
        for shadow in names[1:]:
            modes = {n: "shadow" if n == shadow else "block" for n in names}
            out.append((f"{', '.join(names)}: {shadow} in shadow", FilterConfig(stage_modes=modes), ensemble))
    return out


def cascade_table(
    prompts: list[str], seconds: float, default, ensemble: Ensemble | None, long_count: int = 200, summed=None
) -> None:
    """CPU per prompt and added latency of each cascade, through the filter's own filter_request."""
    long = long_prompts(prompts, count=long_count)
    events = {p: _event(p) for p in [*prompts, *long]}
    configs = cascades(default, ensemble, summed)
    _, rules_config, _ = configs[0]

    def rules(p: str) -> object:
        return filter_request(events[p], rules_config)

    print("  cascade at the filter (filter_request: rules, then each classifier stage, then the event):")
    print(
        f"    {'configuration':<58} {'CPU/prompt':>10} | added over rules alone, corpus prompts: p50 / p99 CPU,"
        " p99 wall | at 4,000 chars: p50 / p99 CPU, p99 wall"
    )
    for name, config, clf in configs:

        def run(p: str, config=config, clf=clf) -> object:
            return filter_request(events[p], config, clf)

        for p in prompts[:50]:
            run(p)
        _, cpu_rate, _, _ = measure(prompts, seconds, run)
        cells = []
        for batch, rounds in ((prompts, 2), (long, 5)):
            p50, p99 = added_latency(batch, rules, run, rounds, clock=time.thread_time)
            _, wall99 = added_latency(batch, rules, run, rounds)
            cells.append(f"{1e6 * p50:6.0f} / {1e6 * p99:6.0f} us, {1e6 * wall99:6.0f} us")
        print(f"    {name[:58]:<58} {1e6 / cpu_rate:7.0f} us | {cells[0]:>41} | {cells[1]:>41}")


def burst(prompts: list[str], ensemble: Ensemble, concurrency: int = 4, count: int = 400) -> None:
    """A burst through the filter as the process runs it: ``concurrency`` worker threads (the filter runs a
    blocking classifier in threads, one per message in flight), each calling filter_request with every
    stage enforced; the encoder batches across them. Per prompt: latency p50 / p99 (wall clock, queueing
    included), process CPU time, and how many prompts an encoder run held on average."""
    from concurrent.futures import ThreadPoolExecutor

    config = FilterConfig(stage_modes=dict.fromkeys(ensemble.names, "block"))
    batch = [_event(p) for p in (prompts * (count // max(len(prompts), 1) + 1))[:count]]
    encoder = next((m.classifier for m in ensemble.members if getattr(m.classifier, "cascade", False)), None)
    batcher = getattr(encoder, "_batcher", None)
    before = (batcher.batches, batcher.prompts) if batcher is not None else (0, 0)

    def one(event: ChatRequested) -> float:
        t0 = time.perf_counter()
        filter_request(event, config, ensemble)
        return time.perf_counter() - t0

    cpu0, wall0 = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        lat = sorted(pool.map(one, batch))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    runs = (batcher.batches - before[0], batcher.prompts - before[1]) if batcher is not None else (0, 0)
    per_run = f", {runs[1] / runs[0]:.1f} prompts per encoder run ({runs[1]} of {count} scored)" if runs[0] else ""
    print(
        f"  burst of {count} prompts, {concurrency} at a time, every stage enforced: {count / wall:.0f} prompts/s,"
        f" latency p50 {1e3 * lat[len(lat) // 2]:.1f} ms, p99 {1e3 * lat[int(len(lat) * 0.99)]:.1f} ms,"
        f" CPU {1e3 * cpu / count:.2f} ms a prompt{per_run}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--classifier", type=Path, default=DEFAULT_ARTIFACT)
    parser.add_argument(
        "--ensemble",
        type=Path,
        default=DEFAULT_ARTIFACT.with_name("ensemble-encoder.json"),
        help="an ensemble manifest (default: the lexical stages and the encoder, after `arena filter-train --encoder`)",
    )
    parser.add_argument(
        "--summed",
        type=Path,
        default=DEFAULT_ARTIFACT.with_name("prompt-embed-sum.npz"),
        help="the character stage summed with the frozen embedding view (`arena filter-train --embed-view`)",
    )
    parser.add_argument(
        "--long", type=int, default=200, help="4,000-character prompts in the cascade table (fewer: a quicker run)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=4, help="prompts in flight in the burst (the filter's workers: 4)"
    )
    args = parser.parse_args(argv)
    prompts, what = load_prompts(args.corpus)
    chars = statistics.median(len(p) for p in prompts)
    print(f"prompt filter speed, one core, {what} (median {chars:.0f} chars)")
    _report("rules", prompts, args.seconds, inspect_prompt)
    if not args.classifier.exists():
        print(f"  no classifier at {args.classifier}: rules only")
        return 0
    clf = load_classifier(args.classifier)
    config = FilterConfig()

    def whole(p: str) -> object:
        return inspect_prompt(p, config, clf)

    _report(f"rules + classifier {clf.version}", prompts, args.seconds, whole)
    long = long_prompts(prompts)
    for name, clock in (("wall clock", time.perf_counter), ("thread CPU time", time.thread_time)):
        p50, p99 = added_latency(long, inspect_prompt, whole, clock=clock)
        print(
            f"  classifier's added latency at 4,000-char prompts ({name}):"
            f" p50 {1e6 * p50:.0f} us, p99 {1e6 * p99:.0f} us"
        )
    ensemble = load_classifier(args.ensemble) if args.ensemble.exists() else None
    summed = load_classifier(args.summed) if args.summed.exists() else None
    cascade_table(prompts, args.seconds, clf, ensemble if isinstance(ensemble, Ensemble) else None, args.long, summed)
    if isinstance(ensemble, Ensemble):
        burst(prompts, ensemble, args.concurrency)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
