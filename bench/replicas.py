"""One inference replica against two, on the same load, through `arena up` as users run it.

    python -m bench.replicas                 # 40 streams x 200 tokens, replicas 1 and 2
    python -m bench.replicas --streams 40 --max-tokens 200 --replicas 1 2 --rounds 2

Each round starts `arena up --inference-replicas N` on a free port (its own state dir),
sends the streams at once (seeded sampling), and records the wall time until the last
stream ends and the tokens per second; the rows are printed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def start(replicas: int, state: Path, settings: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`arena up` as a user's shell starts it (no ARENA_* of the caller's), plus ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_") and k not in ("NATS_URL", "REDIS_URL")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.update(settings or {})
    cmd = [sys.executable, "-m", "infra.cli", "up", "--port", "0", "--state-dir", str(state)]
    proc = subprocess.Popen(
        [*cmd, "--inference-replicas", str(replicas)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready at" in line:
            return proc, json.loads((state / "endpoints.json").read_text())["gateway_url"]
        if proc.poll() is not None:
            break
    raise RuntimeError(f"arena up --inference-replicas {replicas} did not start")


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> int:
    body = {
        "model": "stories-260k",
        "messages": [{"role": "user", "content": f"Once upon a time, story {i}"}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = json.loads(line[6:]).get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
    return tokens


async def load(url: str, streams: int, max_tokens: int) -> tuple[float, list[int]]:
    async with httpx.AsyncClient(timeout=120) as client:
        await one(client, url, -1, 8)  # warm the path
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(client, url, i, max_tokens) for i in range(streams)))
        return time.perf_counter() - t0, list(tokens)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args(argv)
    rows = []
    for _ in range(args.rounds):
        for n in args.replicas:
            with tempfile.TemporaryDirectory() as tmp:
                proc, url = start(n, Path(tmp))
                try:
                    seconds, per_stream = asyncio.run(load(url, args.streams, args.max_tokens))
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
            tokens, answered = sum(per_stream), sum(1 for t in per_stream if t)
            rows.append((n, seconds, answered, tokens, os.getloadavg()[0]))
            print(f"[replicas] {n}: {seconds:.1f} s, {answered} answered, {tokens / seconds:.0f} tok/s", flush=True)
    print(f"\n| replicas | wall s | answered | tok/s | load avg |  ({args.streams} streams x {args.max_tokens} tokens)")
    print("|---|---|---|---|---|")
    for n, seconds, answered, tokens, la in rows:
        print(f"| {n} | {seconds:.1f} | {answered}/{args.streams} | {tokens / seconds:.0f} | {la:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
