"""Goodput: turns answered whole within their deadline, per second, under open-loop arrivals.

    python -m bench.goodput        # arena up, its llama.cpp backend, bare llama-server; 1 to 9 req/s
    python -m bench.goodput --targets arenaflow --rates 3,6 --duration 20

Turns arrive as a Poisson process at each `--rates` level for `--duration` seconds,
whatever the server's state (open loop: a person does not wait for the others' answers),
each a single-turn chat asking for `--tokens` tokens (greedy, end of sequence ignored
where the server allows it). Every target sees the same arrival times and prompts. A turn
ends one way:

- in time: its last token within `--deadline` (15 s, the arena's): the only one that counts;
- refused: 429 up front, or refused by a worker before its first token;
- late: answered whole after the deadline, or not at all after `--give-up` seconds (a
  server without deadlines: a first-come-first-served queue answers everyone late);
- cut: admitted, then ended by the server at its deadline;
- error: anything else (a 400 included).

Goodput is the turns in time over the level's seconds. The targets run one after
another in one run, each alone on the machine (started, offered every rate, stopped):
started side by side, an idle `arena up` still steps (its engines probe their step times
while the CPU is contended), and llama.cpp's threads, which spin at each step's barrier,
slowed bare llama-server 10x beside them (372 ms a token at 4 requests).
`--together` starts them all first and offers each rate to each in turn. Prints one
table row per target and rate (goodput,
counts, P50 / P99 latency of the answers that came back whole) and the load average, and
writes `goodput.json` under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

from bench import admission, peers, procs, targets
from bench.admission import Attempt, classify
from bench.client import chat_body, session
from bench.stats import percentile
from bench.workload import PROMPTS

OUTCOMES = ("in_time", "refused", "late", "cut", "error")
DEFAULT_TARGETS = "arenaflow,arenaflow-llamacpp,llama-server"


def arrivals(rate: float, duration_s: float, seed: int = 0) -> list[float]:
    """Poisson arrival times (seconds from the level's start) at `rate` per second."""
    rng, at, times = random.Random(f"{seed}-{rate}"), 0.0, []
    while (at := at + rng.expovariate(rate)) < duration_s:
        times.append(at)
    return times


def outcome(attempt: Attempt, deadline_s: float) -> str:
    """How a turn ended for goodput (`OUTCOMES`), from `bench.admission.classify`'s
    outcome: a miss is `cut` when the server ended it at its deadline, `late` when the
    answer came after it or the client gave up waiting."""
    base = classify(attempt, deadline_s)
    if base == "answered":
        return "in_time"
    if base in ("refused", "refused_late"):
        return "refused"
    if base == "missed":
        cut = attempt.error_code == "deadline_exceeded" or (attempt.error or "").startswith("HTTP 504")
        return "cut" if cut else "late"
    return "error"


@dataclass(frozen=True)
class Tally:
    """One target at one rate: the turns by outcome and the answers' latencies."""

    offered: int
    counts: dict[str, int]
    goodput: float  # turns in time per second of arrivals
    p50_s: float | None  # of the answers that came back whole, in time or late
    p99_s: float | None

    def as_json(self) -> dict:
        return {"offered": self.offered, "goodput": self.goodput, "p50_s": self.p50_s, "p99_s": self.p99_s} | {
            k: v for k, v in self.counts.items()
        }


def tally(attempts: list[Attempt], duration_s: float, deadline_s: float) -> Tally:
    """The level's figures (`Tally`) from its attempts."""
    by = [outcome(a, deadline_s) for a in attempts]
    counts = {o: by.count(o) for o in OUTCOMES}
    whole = [a.latency_s for a, o in zip(attempts, by, strict=True) if o in ("in_time", "late") and a.latency_s]
    return Tally(len(attempts), counts, counts["in_time"] / duration_s, percentile(whole, 50), percentile(whole, 99))


async def offer(
    target: targets.Target, rate: float, duration_s: float, tokens: int, deadline_s: float, give_up_s: float, seed: int
) -> list[Attempt]:
    """Send a turn at each of the level's arrival times; every turn's attempt once all ended."""
    rng = random.Random(seed)
    times = arrivals(rate, duration_s, seed)
    async with session(give_up_s, connections=len(times) + 1) as client:
        t0 = time.perf_counter()

        async def turn(i: int, at: float, prompt: str) -> Attempt:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            body = chat_body(target.served_name, [{"role": "user", "content": prompt}], tokens, target.send_ignore_eos)
            return await admission.send(client, target.base_url, body, Attempt(i, 0, tokens, 0.0), deadline_s)

        return list(await asyncio.gather(*(turn(i, at, rng.choice(PROMPTS)) for i, at in enumerate(times))))


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


HEAD = (
    "| rate (req/s) | target | offered | in time | goodput (turns/s) | x llama-server | refused | late | cut "
    "| errors | answered P50 / P99 s | load avg |"
)


def table(rows: list[dict], peer: str = "llama-server") -> str:
    """The rows as a markdown table, each with its ratio to `peer`'s goodput at the same rate."""
    lines = [HEAD, "|" + "---|" * 12]
    for r in rows:
        t = r["tally"]
        base = next((p["tally"]["goodput"] for p in rows if p["target"] == peer and p["rate"] == r["rate"]), None)
        ratio = f"{t['goodput'] / base:.2f}" if base else "-"
        lines.append(
            f"| {r['rate']:g} | {r['target']} | {t['offered']} | {t['in_time']} | {t['goodput']:.2f} | {ratio} "
            f"| {t['refused']} | {t['late']} | {t['cut']} | {t['error']} | {fmt(t['p50_s'])} / {fmt(t['p99_s'])} "
            f"| {r['load']} |"
        )
    return "\n".join(lines)


def load_avg() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def measure(live: dict[str, targets.Target], args: argparse.Namespace, before: list[dict]) -> list[dict]:
    """Each rate offered to each live target in turn; the rows (`before`: the run's rows so
    far, for the printed ratio to llama-server)."""
    rows: list[dict] = []
    for rate in [float(x) for x in args.rates.split(",") if x]:
        for name, target in live.items():
            time.sleep(args.settle)  # the last level's stragglers end, the machine calms
            load = load_avg()
            attempts = asyncio.run(
                offer(target, rate, args.duration, args.tokens, args.deadline, args.give_up, args.seed)
            )
            row = {"rate": rate, "target": name, "load": load, "margin": admission.learned_margin(target)}
            row["tally"] = tally(attempts, args.duration, args.deadline).as_json()
            rows.append(row | {"attempts": [a.as_json() for a in attempts]})
            print(table(before + rows).splitlines()[-1], flush=True)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default=DEFAULT_TARGETS, help=f"comma-separated, of {', '.join(targets.BUILDERS)}")
    p.add_argument("--model", default=peers.SMOLLM2, help="pkg: or .gguf source (default: SmolLM2-135M)")
    p.add_argument("--rates", default="1,2,3,4.5,6,9", help="turns per second offered, one level after another")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per level")
    p.add_argument("--tokens", type=int, default=64, help="max_tokens of every turn")
    p.add_argument("--deadline", type=float, default=15.0, help="the deadline a turn is counted in time by")
    p.add_argument("--give-up", type=float, default=60.0, help="seconds a client waits for an answer at most")
    p.add_argument("--settle", type=float, default=3.0, help="seconds between levels")
    p.add_argument("--parallel", type=int, default=32, help="llama-server's slots, both bare and as the backend")
    p.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server's context per slot")
    p.add_argument("--together", action="store_true", help="start every target first, offer each rate to each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/goodput"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    procs.install_cleanup()
    args.out.mkdir(parents=True, exist_ok=True)
    source = str(args.model)
    checkpoint, name = peers.served(source)
    setup = targets.Setup(
        checkpoint, name, args.out, source=source, parallel=args.parallel, ctx_per_slot=args.ctx_per_slot
    )
    print(f"[goodput] {time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} CPUs, load {load_avg()}", flush=True)
    names = [n for n in args.targets.split(",") if n]
    rows: list[dict] = []
    print(table([]), flush=True)
    for group in [names] if args.together else [[n] for n in names]:
        with contextlib.ExitStack() as stack:
            rows += measure(admission.start(group, setup, stack, args.deadline, "goodput"), args, rows)
    return admission.written(args, rows, table(rows), "goodput")


if __name__ == "__main__":
    raise SystemExit(main())
