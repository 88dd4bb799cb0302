"""Load generator for any OpenAI-compatible chat-completions endpoint on this machine.

    python -m bench.loadgen --base http://127.0.0.1:8000 --model llama-60m \\
        --mode closed --loads 1,4,8 --lengths 16:0.8,128:0.2 --duration 20 --out bench/results/lg

Each load level is bounded twice: no new session starts after `--duration` seconds or
once `--max-requests` requests were sent; requests in flight then finish (each within
`--timeout`). Writes `loadgen.json`, `loadgen.md` and `loadgen.png` under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import replace
from pathlib import Path

from bench.client import RequestRecord, chat_body, check_local, session, stream_chat
from bench.stats import summarize
from bench.workload import LengthMix, Workload, draw_session


class _Budget:
    """Shared stop condition of one level: a deadline and a request count."""

    def __init__(self, workload: Workload, t0: float) -> None:
        self.deadline = t0 + workload.duration_s
        self.left = workload.max_requests

    def take(self) -> bool:
        if self.left <= 0 or time.perf_counter() >= self.deadline:
            return False
        self.left -= 1
        return True


async def _session(client, base, workload, turns, session_id, budget, t0, out) -> None:
    messages: list[dict] = []
    for index, turn in enumerate(turns):
        if not budget.take():
            return
        messages.append({"role": "user", "content": turn.user_message})
        record = RequestRecord(session=session_id, turn=index, max_tokens=turn.max_tokens, start_s=0.0)
        extra = dict(workload.body_extra)
        body = chat_body(workload.model, list(messages), turn.max_tokens, workload.ignore_eos, extra)
        await stream_chat(client, base, body, record, t0)
        out.append(record)
        if record.status != "ok":
            return
        messages.append({"role": "assistant", "content": record.text})


async def _closed_loop(client, base, workload, budget, t0, out) -> None:
    async def user(user_id: int) -> None:
        rng = random.Random(f"{workload.seed}-{user_id}")
        session = 0
        while budget.left > 0 and time.perf_counter() < budget.deadline:
            turns = draw_session(workload, rng)
            await _session(client, base, workload, turns, user_id * 100_000 + session, budget, t0, out)
            session += 1

    await asyncio.gather(*(user(u) for u in range(workload.concurrency)))


async def _open_loop(client, base, workload, budget, t0, out) -> None:
    rng = random.Random(workload.seed)
    tasks = []
    next_at = t0
    session = 0
    while budget.left > 0:
        next_at += rng.expovariate(workload.rate)
        if next_at >= budget.deadline:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        turns = draw_session(workload, rng)
        tasks.append(asyncio.create_task(_session(client, base, workload, turns, session, budget, t0, out)))
        session += 1
    await asyncio.gather(*tasks)


async def run_level(base_url: str, workload: Workload) -> dict:
    """Run one load level; returns its summary, workload and per-request records."""
    base = check_local(base_url)
    records: list[RequestRecord] = []
    async with session(workload.timeout_s, connections=max(workload.concurrency, 64) * 2) as client:
        t0 = time.perf_counter()
        budget = _Budget(workload, t0)
        driver = _closed_loop if workload.mode == "closed" else _open_loop
        await driver(client, base, workload, budget, t0, records)
    rows = [r.as_json() for r in records]
    ends = [r.start_s + (r.latency_s or 0.0) for r in records]
    wall = max(ends, default=0.0) - min((r.start_s for r in records), default=0.0)
    return {
        "load": workload.offered_load,
        "load_label": workload.load_label,
        "mode": workload.mode,
        "lengths": str(workload.lengths),
        "turns": workload.turns,
        "summary": summarize(rows, wall),
        "records": rows,
    }


async def warm_up(base_url: str, workload: Workload, requests: int = 2, max_tokens: int = 4) -> dict:
    """A few short requests, so first-call costs stay out of the figures; returns the level."""
    level = replace(
        workload,
        mode="closed",
        concurrency=1,
        max_requests=requests,
        duration_s=120.0,
        lengths=LengthMix(((max_tokens, 1.0),)),
        turns=1,
    )
    return await run_level(base_url, level)


async def sweep(base_url: str, workload: Workload, loads: list[float]) -> list[dict]:
    """`run_level` for each offered load, lowest first."""
    levels = []
    for load in loads:
        if workload.mode == "closed":
            level = replace(workload, concurrency=int(load))
        else:
            level = replace(workload, rate=float(load))
        levels.append(await run_level(base_url, level))
    return levels


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Workload options shared with `bench.compare`."""
    parser.add_argument("--mode", choices=("closed", "open"), default="closed")
    parser.add_argument(
        "--loads", default="1,4,8", help="concurrent users (closed) or requests/s (open), comma-separated"
    )
    parser.add_argument("--lengths", default="16:0.8,128:0.2", help="max_tokens[:weight],...")
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per load level")
    parser.add_argument("--max-requests", type=int, default=200, help="per load level")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature (default 0: greedy, as the peer comparisons ask; 1 is the API's default)",
    )


def workload_from_args(args: argparse.Namespace, model: str) -> tuple[Workload, list[float]]:
    workload = Workload(
        model=model,
        mode=args.mode,
        duration_s=args.duration,
        max_requests=args.max_requests,
        lengths=LengthMix.parse(args.lengths),
        turns=args.turns,
        seed=args.seed,
        timeout_s=args.timeout,
        body_extra=(("temperature", args.temperature),) if args.temperature else (),
    )
    return workload, [float(x) for x in args.loads.split(",")]


def main(argv: list[str] | None = None) -> int:
    from bench.report import write_report

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--name", default="target", help="row label in the report")
    parser.add_argument("--out", type=Path, default=Path("bench/results/loadgen"))
    add_workload_args(parser)
    args = parser.parse_args(argv)
    workload, loads = workload_from_args(args, args.model)

    async def go() -> list[dict]:
        await warm_up(args.base, workload)
        return await sweep(args.base, workload, loads)

    levels = asyncio.run(go())
    results = {"targets": [{"name": args.name, "status": "ok", "levels": levels}]}
    paths = write_report(results, args.out, stem="loadgen")
    print((args.out / "loadgen.md").read_text())
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
