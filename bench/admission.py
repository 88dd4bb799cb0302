"""Does admission hold on the real model? Conversations at the default deadline.

    python -m bench.admission                                   # arena up's defaults: 8, 32, 64 users, then a burst
    python -m bench.admission --targets arenaflow,llama-server --loads 32 --burst 400
    python -m bench.admission --targets arenaflow-llamacpp,llama-server --interleave

Each user holds conversations of `--turns` turns, the history carried (every turn
prefills the whole conversation so far), answer budgets drawn from `--lengths`, and idles
`--think` seconds (drawn 0.5-1.5x) between turns, as a person reads and types. Nothing
asks for a longer deadline: every request carries the server's default (15 s, or
`--deadline` for the servers that have none), and a client that is refused waits its
`Retry-After` (at most `--max-retry-wait`) and sends the same turn again, as the OpenAI
SDK does. Every attempt ends one way:

- answered: its last token within the deadline;
- refused: 429 up front (`refused`), or an `overloaded` error before any token from a
  worker that pulled it too late (`refused late`, counted in the share refused);
- rejected: a 4xx that says the request can never finish in time (`deadline_too_short`);
- missed: admitted, then ended by its deadline (504 or a `deadline_exceeded` event), or,
  on a server without deadlines, answered after it: the battle is lost;
- error: anything else.

Then `--burst` single-turn requests (64 tokens) sent at once, classified the same way.
Prints a table per target and load (attempts, answered, share refused, missed, errors,
latency P50/P99 of the answered, TTFT P99, the longest prompt answered and missed) and
writes `admission.json` under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench import peers, procs, targets
from bench.client import RequestRecord, chat_body, check_local, session, stream_chat
from bench.stats import percentile
from bench.workload import FOLLOW_UPS, PROMPTS, LengthMix

OUTCOMES = ("answered", "refused", "refused_late", "rejected", "missed", "error")


@dataclass
class Attempt(RequestRecord):
    """One request sent (`session` is its user), as `bench.client` records it, and how it
    ended for the battle (`outcome`)."""

    outcome: str = "error"
    retry: int = 0  # how many times this turn was sent before
    lost: bool = False  # the turn's last attempt: it was not answered (refused through every retry, or missed)


def classify(attempt: Attempt, deadline_s: float) -> str:
    """The attempt's outcome from its HTTP status and the error its stream or body carried."""
    status, code = attempt.http_status, attempt.error_code
    if status == 429:
        return "refused"
    if status == 504 or code == "deadline_exceeded":  # a client timeout past the deadline too
        return "missed"
    if status is not None and 400 <= status < 500:
        return "rejected" if code == "deadline_too_short" else "error"
    if code == "overloaded" and attempt.output_tokens == 0:
        return "refused_late"
    if attempt.error is not None or status != 200 or attempt.latency_s is None:
        return "error"
    return "missed" if attempt.latency_s > deadline_s else "answered"


async def send(client: aiohttp.ClientSession, base: str, body: dict, attempt: Attempt, deadline_s: float) -> Attempt:
    """Send one streamed chat request (`bench.client.stream_chat`) and classify it; never
    raises for HTTP trouble."""
    t0 = time.perf_counter()
    await stream_chat(client, base, body, attempt, t0)
    waited = time.perf_counter() - t0
    if attempt.latency_s is None and attempt.error_code is None and waited > deadline_s:
        # The client gave up (or the connection broke) past the deadline: the battle is lost.
        attempt.http_status, attempt.latency_s = 504, waited
    attempt.outcome = classify(attempt, deadline_s)
    return attempt


@dataclass(frozen=True)
class Level:
    users: int
    turns: int
    lengths: LengthMix
    think_s: float
    duration_s: float
    deadline_s: float
    max_retry_wait_s: float
    retries: int = 2
    seed: int = 0
    temperature: float = 0.0  # 0: greedy; 1: the API's default sampling


async def conversation_user(client, target: targets.Target, level: Level, user: int, stop_at: float, out: list):
    """One person: conversations of `level.turns` turns until the level's time is up."""
    rng = random.Random(f"{level.seed}-{user}")
    await asyncio.sleep(rng.uniform(0, level.think_s))  # people do not all start at once
    while time.perf_counter() < stop_at:
        messages: list[dict] = []
        for turn in range(level.turns):
            content = rng.choice(PROMPTS) if turn == 0 else rng.choice(FOLLOW_UPS)
            messages.append({"role": "user", "content": content})
            max_tokens = level.lengths.draw(rng)
            for retry in range(level.retries + 1):
                if time.perf_counter() >= stop_at:
                    return
                body = chat_body(
                    target.served_name, messages, max_tokens, target.send_ignore_eos, temperature=level.temperature
                )
                attempt = await send(
                    client, target.base_url, body, Attempt(user, turn, max_tokens, 0.0), level.deadline_s
                )
                attempt.retry = retry
                out.append(attempt)
                if attempt.outcome not in ("refused", "refused_late") or retry == level.retries:
                    break
                await asyncio.sleep(min(attempt.retry_after_s or 1.0, level.max_retry_wait_s))
            if attempt.outcome != "answered":
                attempt.lost = True
                break  # the turn is lost: the person starts over
            messages.append({"role": "assistant", "content": attempt.text})
            await asyncio.sleep(level.think_s * rng.uniform(0.5, 1.5))


async def run_level(target: targets.Target, level: Level) -> list[Attempt]:
    out: list[Attempt] = []
    stop_at = time.perf_counter() + level.duration_s
    async with session(level.deadline_s * 8, connections=level.users * 2) as client:
        await asyncio.gather(*(conversation_user(client, target, level, u, stop_at, out) for u in range(level.users)))
    return out


async def run_burst(
    target: targets.Target, n: int, max_tokens: int, deadline_s: float, temperature: float = 0.0
) -> tuple[list[Attempt], float]:
    """`n` single-turn requests at once; (their attempts, the wall time until the last ended)."""
    rng = random.Random(0)
    async with session(deadline_s * 8, connections=n) as client:
        t0 = time.perf_counter()
        attempts = await asyncio.gather(
            *(
                send(
                    client,
                    target.base_url,
                    chat_body(
                        target.served_name,
                        [{"role": "user", "content": rng.choice(PROMPTS)}],
                        max_tokens,
                        temperature=temperature,
                    ),
                    Attempt(i, 0, max_tokens, 0.0),
                    deadline_s,
                )
                for i in range(n)
            )
        )
        for a in attempts:
            a.lost = a.outcome != "answered"  # no retry in a burst: each request is its own turn
        return list(attempts), time.perf_counter() - t0


def summary(attempts: list[Attempt]) -> dict:
    """One row: counts by outcome, the share refused, latencies of the answered; and by
    turn (a turn is sent again after a refusal, `retries` times at most): answered, lost."""
    by = {o: [a for a in attempts if a.outcome == o] for o in OUTCOMES}
    answered = by["answered"]
    refused = len(by["refused"]) + len(by["refused_late"])
    missed_prompts = [a.prompt_tokens for a in by["missed"] if a.prompt_tokens is not None]
    turns = [a for a in attempts if a.outcome == "answered" or a.lost or a.outcome in ("missed", "error", "rejected")]
    lost_refused = [a for a in attempts if a.lost and a.outcome in ("refused", "refused_late")]
    by_budget = {}
    for budget in sorted({a.max_tokens for a in attempts}):
        mine = [a for a in turns if a.max_tokens == budget]
        by_budget[str(budget)] = {
            "turns": len(mine),
            "answered": sum(a.outcome == "answered" for a in mine),
            "lost_refused": sum(a in lost_refused for a in mine),
            "missed": sum(a.outcome == "missed" for a in mine),
            "latency_p99_s": percentile([a.latency_s for a in mine if a.outcome == "answered" and a.latency_s], 99),
        }
    return {
        "attempts": len(attempts),
        **{o: len(v) for o, v in by.items()},
        "refused_share": refused / len(attempts) if attempts else None,
        "missed_share_of_admitted": len(by["missed"]) / max(1, len(attempts) - refused - len(by["rejected"])),
        "turns": len(turns),
        "turns_lost_refused": len(lost_refused),
        "by_budget": by_budget,
        "latency_p50_s": percentile([a.latency_s for a in answered if a.latency_s is not None], 50),
        "latency_p99_s": percentile([a.latency_s for a in answered if a.latency_s is not None], 99),
        "latency_max_s": max((a.latency_s for a in answered if a.latency_s is not None), default=None),
        "ttft_p99_s": percentile([a.ttft_s for a in answered if a.ttft_s is not None], 99),
        "output_tokens": sum(a.output_tokens for a in answered),
        "prompt_tokens_max_answered": max((a.prompt_tokens or 0 for a in answered), default=None),
        "prompt_tokens_max_missed": max(missed_prompts, default=None),
        "errors_seen": sorted({a.error for a in by["error"] if a.error})[:3],
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = (
        "| target | load | turns | answered | lost to refusals | missed | 400 too long | errors "
        "| attempts refused (late) "
        "| latency P50 / P99 / max s | TTFT P99 s | tok/s | answered / turns by budget | longest prompt answered "
        "| margin after |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        s = r["summary"]
        budgets = ", ".join(f"{k}: {v['answered']}/{v['turns']}" for k, v in s["by_budget"].items())
        lines.append(
            f"| {r['target']} | {r['load']} | {s['turns']} | {s['answered']} | {s['turns_lost_refused']} "
            f"| {s['missed']} | {s['rejected']} | {s['error']} "
            f"| {s['refused'] + s['refused_late']} of {s['attempts']} ({s['refused_late']}) "
            f"| {fmt(s['latency_p50_s'])} / {fmt(s['latency_p99_s'])} / {fmt(s['latency_max_s'])} "
            f"| {fmt(s['ttft_p99_s'])} | {s['output_tokens'] / r['wall_s']:.1f} | {budgets} "
            f"| {s['prompt_tokens_max_answered'] or '-'} | {fmt(r.get('margin'))} |"
        )
    return "\n".join(lines)


async def warm(target: targets.Target, deadline_s: float) -> None:
    """A few requests, one after another, then 4 at once: the stack measures its steps."""
    async with session(120) as client:
        for _ in range(3):
            body = chat_body(target.served_name, [{"role": "user", "content": PROMPTS[0]}], 16)
            await send(client, target.base_url, body, Attempt(0, 0, 16, 0.0), deadline_s)
        bodies = [chat_body(target.served_name, [{"role": "user", "content": p}], 32) for p in PROMPTS[:4]]
        await asyncio.gather(*(send(client, target.base_url, b, Attempt(0, 0, 32, 0.0), deadline_s) for b in bodies))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default="arenaflow", help=f"comma-separated, of {', '.join(targets.BUILDERS)}")
    p.add_argument("--model", default=peers.SMOLLM2, help="pkg: or .gguf source (default: SmolLM2-135M)")
    p.add_argument("--loads", default="8,32,64", help="users at once, one level after another")
    p.add_argument("--turns", type=int, default=6, help="turns of a conversation")
    p.add_argument("--lengths", default="64:0.7,256:0.3", help="answer budgets, TOKENS:WEIGHT,...")
    p.add_argument("--think", type=float, default=3.0, help="seconds a person idles between turns (0.5-1.5x)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds a level sends new turns")
    p.add_argument("--deadline", type=float, default=15.0, help="the deadline a client holds a server to")
    p.add_argument("--max-retry-wait", type=float, default=5.0, help="longest Retry-After a client honours")
    p.add_argument("--retries", type=int, default=2, help="times a refused turn is sent again (the OpenAI SDK's 2)")
    p.add_argument("--burst", type=int, default=400, help="requests sent at once after the levels (0: none)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; 1: the API's default sampling")
    p.add_argument("--ctx-per-slot", type=int, default=2048, help="llama-server's context per slot")
    p.add_argument("--torch-threads", type=int, help="threads every server may use (default: the supervisor's)")
    p.add_argument("--interleave", action="store_true", help="start every target at once, run each level on each")
    p.add_argument("--out", type=Path, default=Path("bench/results/admission"))
    return p.parse_args(argv)


def prepare(name: str, setup: targets.Setup) -> targets.Target:
    """The target as users run it: no longer deadline than the server's own."""
    target = targets.prepare(name, setup)
    return targets.Target(target.name, target.process, target.served_name, target.base_url, target.send_ignore_eos)


def learned_margin(target: targets.Target) -> float | None:
    """The margin an arenaflow gateway learned for the model (`arena_admission_margin`),
    None for a server without one."""
    with contextlib.suppress(Exception):
        text = urllib.request.urlopen(f"{target.base_url}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(f'arena_admission_margin{{model="{target.served_name}"}}'):
                return float(line.rsplit(" ", 1)[1])
    return None


def measure(live: dict[str, targets.Target], args, rows: list[dict]) -> None:
    lengths = LengthMix.parse(args.lengths)
    for users in [int(x) for x in args.loads.split(",") if x]:
        level = Level(
            users,
            args.turns,
            lengths,
            args.think,
            args.duration,
            args.deadline,
            args.max_retry_wait,
            args.retries,
            temperature=args.temperature,
        )
        for name, target in live.items():
            t0 = time.perf_counter()
            attempts = asyncio.run(run_level(target, level))
            level_row = {"target": name, "load": f"{users} users", "wall_s": time.perf_counter() - t0}
            level_row["margin"] = learned_margin(target)
            level_row |= {"level": asdict(level) | {"lengths": str(lengths)}, "summary": summary(attempts)}
            rows.append(level_row | {"attempts": [a.as_json() for a in attempts]})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    if args.burst:
        for name, target in live.items():
            time.sleep(args.think * 2)  # the levels' last turns drain
            attempts, wall = asyncio.run(run_burst(target, args.burst, 64, args.deadline, args.temperature))
            burst_row = {"target": name, "load": f"burst {args.burst}", "wall_s": wall, "summary": summary(attempts)}
            burst_row["margin"] = learned_margin(target)
            rows.append(burst_row | {"attempts": [a.as_json() for a in attempts]})
            print(table(rows[-1:]).splitlines()[-1], flush=True)


def start(
    names: list[str], setup: targets.Setup, stack: contextlib.ExitStack, deadline_s: float, say: str = "admission"
):
    """The targets named, started (each stopped when `stack` closes), ready and warmed up
    (`warm`), by name; one that cannot run here is said and left out."""
    live: dict[str, targets.Target] = {}
    for name in names:
        try:
            target = prepare(name, setup)
            stack.enter_context(target.process).wait_ready(300)
        except (targets.NotRunnable, procs.ServerFailed) as exc:
            print(f"[{say}] {name}: not run: {exc}", flush=True)
            continue
        check_local(target.base_url)
        asyncio.run(warm(target, deadline_s))
        live[name] = target
    return live


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    procs.install_cleanup()
    args.out.mkdir(parents=True, exist_ok=True)
    source = str(args.model)
    checkpoint, name = peers.served(source)
    loads = [int(x) for x in args.loads.split(",") if x]
    setup = targets.Setup(
        checkpoint,
        name,
        args.out,
        torch_threads=args.torch_threads,
        source=source,
        parallel=max([*loads, 1]),
        ctx_per_slot=args.ctx_per_slot,
    )
    names = [n for n in args.targets.split(",") if n]
    rows: list[dict] = []
    print(table([]), flush=True)
    groups = [names] if args.interleave else [[n] for n in names]
    for group in groups:
        with contextlib.ExitStack() as stack:
            measure(start(group, setup, stack, args.deadline), args, rows)
    return written(args, rows, table(rows), "admission")


def written(args: argparse.Namespace, rows: list[dict], text: str, stem: str) -> int:
    """The run's arguments and rows into `<out>/<stem>.json`; its table printed; exit status 0."""
    (args.out / f"{stem}.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
    )
    print(f"\n{text}\n\nwritten to {args.out / f'{stem}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
