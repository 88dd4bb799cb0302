"""How many open connections one gateway holds: idle WebSockets, and SSE streams in flight.

    python -m bench.connections                              # 1k, 5k, 10k idle sockets; 64 and 256 streams
    python -m bench.connections --sockets 1000 5000 10000 --streams 64 256 --hold 20
    python -m bench.connections --env ARENA_WS_PER_MESSAGE_DEFLATE=0   # a setting of the gateway's, for one run

Starts `arena up` (its defaults, its own state dir and port), then opens idle WebSockets in
waves up to each level, as a crowd arrives and then reads and types. At each level it
prints the gateway's file descriptors, memory (RSS and PSS, per socket over the idle
gateway), the time to open the wave, the errors seen, and the event loop's lag as a
client sees it: the round trip of `GET /healthz` and of a `ping` frame on a sample of the
open sockets (P50/P99, ms), then holds them `--hold` seconds and pings every one.

Then SSE: `--streams` streaming chat requests sent at once (64 tokens each): how many were
admitted (200) or refused up front (429), the most in flight at once, and the P99 to the
first token and to the end. The load generator runs on the same machine (2 cores here):
its own CPU is part of what the figures pay.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import websockets

from bench.replicas import start


def pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def gateway_of(proc: psutil.Process) -> psutil.Process:
    for child in proc.children(recursive=True):
        if "gateway" in child.cmdline():
            return child
    raise RuntimeError("no gateway process under arena up")


def memory(gw: psutil.Process) -> tuple[int, float, float]:
    info = gw.memory_full_info()
    return gw.num_fds(), info.rss / 2**20, info.pss / 2**20


async def healthz_ms(url: str, n: int = 40) -> list[float]:
    out = []
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            r = await client.get(f"{url}/healthz")
            r.raise_for_status()
            out.append((time.perf_counter() - t0) * 1000)
    return out


async def ping_ms(sock) -> float:
    t0 = time.perf_counter()
    await sock.send('{"type": "ping"}')
    while json.loads(await asyncio.wait_for(sock.recv(), 60))["type"] != "pong":
        pass
    return (time.perf_counter() - t0) * 1000


class Crowd:
    """Idle WebSockets, opened in waves; the errors met on the way, by kind."""

    def __init__(self, url: str):
        self.url = url.replace("http://", "ws://") + "/v1/ws"
        self.sockets: list = []
        self.errors: dict[str, int] = {}

    async def _one(self) -> None:
        try:
            sock = await websockets.connect(self.url, open_timeout=60, max_queue=4)
            if json.loads(await asyncio.wait_for(sock.recv(), 60))["type"] != "session":
                raise RuntimeError("no session frame")
            self.sockets.append(sock)
        except Exception as exc:  # noqa: BLE001 - every failure is counted by kind, the run goes on
            kind = type(exc).__name__
            self.errors[kind] = self.errors.get(kind, 0) + 1

    async def grow(self, to: int, wave: int = 250) -> float:
        t0 = time.perf_counter()
        while len(self.sockets) < to:
            before = len(self.sockets) + sum(self.errors.values())
            await asyncio.gather(*(self._one() for _ in range(min(wave, to - len(self.sockets)))))
            if len(self.sockets) + sum(self.errors.values()) == before or sum(self.errors.values()) > to:
                break
        return time.perf_counter() - t0

    async def close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.sockets), return_exceptions=True)


async def idle_levels(url: str, gw: psutil.Process, levels: list[int], hold_s: float) -> None:
    fds0, rss0, pss0 = memory(gw)
    base = await healthz_ms(url)
    print(
        f"idle gateway: {fds0} fds, RSS {rss0:.0f} MiB, PSS {pss0:.0f} MiB; /healthz P50/P99 "
        f"{pct(base, 50):.1f}/{pct(base, 99):.1f} ms"
    )
    print(
        f"{'sockets':>8} {'open s':>7} {'errors':>8} {'fds':>6} {'RSS MiB':>8} {'PSS MiB':>8} "
        f"{'KiB/sock':>8} {'healthz P50/P99':>16} {'ping P50/P99':>14} {'alive':>7}"
    )
    crowd = Crowd(url)
    try:
        for level in levels:
            took = await crowd.grow(level)
            fds, rss, pss = memory(gw)
            health = await healthz_ms(url)
            sample = crowd.sockets[:: max(1, len(crowd.sockets) // 200)]
            pings = [await ping_ms(s) for s in sample]
            await asyncio.sleep(hold_s)
            alive = await asyncio.gather(*(ping_ms(s) for s in crowd.sockets), return_exceptions=True)
            ok = sum(not isinstance(a, BaseException) for a in alive)
            per = (pss - pss0) * 1024 / max(1, len(crowd.sockets))
            errors = sum(crowd.errors.values())
            print(
                f"{len(crowd.sockets):>8} {took:>7.1f} {errors:>8} {fds:>6} {rss:>8.0f} {pss:>8.0f} {per:>8.1f} "
                f"{pct(health, 50):>7.1f}/{pct(health, 99):<8.1f} {pct(pings, 50):>6.1f}/{pct(pings, 99):<7.1f} "
                f"{ok:>7}"
            )
            if crowd.errors:
                print(f"         errors by kind: {crowd.errors}")
    finally:
        await crowd.close()


async def one_stream(client: httpx.AsyncClient, url: str, i: int, live: list[int], seen: list) -> None:
    body = {
        "model": "stories-260k",
        "messages": [{"role": "user", "content": f"Once upon a time, story {i}"}],
        "max_tokens": 64,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
    }
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            seen.append((r.status_code, None, None))
            return
        live[0] += 1
        live[1] = max(live[1], live[0])
        try:
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - t0
        finally:
            live[0] -= 1
    seen.append((200, first, time.perf_counter() - t0))


async def sse_levels(url: str, gw: psutil.Process, levels: list[int]) -> None:
    print(
        f"\n{'streams':>8} {'200':>5} {'429':>5} {'other':>6} {'most in flight':>15} {'TTFT P99 s':>11} "
        f"{'end P99 s':>10} {'fds peak':>9}"
    )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    for n in levels:
        live, seen = [0, 0], list[tuple[int, float | None, float | None]]()
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            task = asyncio.gather(*(one_stream(client, url, i, live, seen) for i in range(n)))
            peak_fds = 0
            while not task.done():
                peak_fds = max(peak_fds, gw.num_fds())
                await asyncio.sleep(0.1)
            await task
        ok = [s for s in seen if s[0] == 200]
        refused = sum(1 for s in seen if s[0] == 429)
        ttft = [s[1] for s in ok if s[1] is not None]
        print(
            f"{n:>8} {len(ok):>5} {refused:>5} {len(seen) - len(ok) - refused:>6} {live[1]:>15} "
            f"{pct(ttft, 99):>11.2f} {pct([s[2] for s in ok if s[2] is not None], 99):>10.2f} {peak_fds:>9}"
        )
        await asyncio.sleep(2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--sockets", type=int, nargs="+", default=[1000, 5000, 10000], help="idle WebSocket levels")
    p.add_argument("--streams", type=int, nargs="*", default=[64, 256], help="SSE streams sent at once")
    p.add_argument("--hold", type=float, default=10.0, help="seconds each level is held before every socket is pinged")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for arena up (a gateway setting)")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the client holds one descriptor a socket too
    print(f"open-file limit: {hard} (client and gateway); levels {args.sockets}")
    settings = dict(pair.partition("=")[::2] for pair in args.env)
    with tempfile.TemporaryDirectory(prefix="arena-conns-") as tmp:
        proc, url = start(1, Path(tmp) / "state", settings)
        try:
            gw = gateway_of(psutil.Process(proc.pid))
            asyncio.run(idle_levels(url, gw, args.sockets, args.hold))
            if args.streams:
                asyncio.run(sse_levels(url, gw, args.streams))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
