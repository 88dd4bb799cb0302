"""What JetStream's fsync policy costs: `sync_interval: always` (every write on disk before
its ack) against a periodic sync (nats-server's default, 2 min), side by side in one run.

    python -m bench.sync_policy                      # always against 2m
    python -m bench.sync_policy --policies always,1s,2m --users 1,8,32 --rounds 4 --round-s 15

Two measurements per policy:
- JetStream alone: a nats-server started as `arena up` starts it (its generated config),
  publishes of a request-sized message acknowledged one at a time and 32 in flight;
- the gateway: one `arena up --nats-sync POLICY` per policy, all up at once, driven in
  alternating rounds (so a busy moment of a shared machine falls on each alike) by
  closed-loop users sending chat requests through the whole pipeline (each request is
  five or more acknowledged writes: requested, accepted, token chunks, completed).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import nats
from nats.js.api import StorageType, StreamConfig

from bench.procs import ServerProcess, install_cleanup
from bench.stats import percentile
from infra.servers import nats_server_config, nats_sync, start_nats
from runtime.net import free_port

PAYLOAD = b"x" * 600  # about a ChatRequested with a short conversation


async def _publishes(url: str, count: int, in_flight: int) -> tuple[float, list[float]]:
    """Publishes per second and each publish's time to its ack."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    stream = f"SYNC{in_flight}"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"], storage=StorageType.FILE))
    gate = asyncio.Semaphore(in_flight)
    acked: list[float] = []

    async def one(i: int) -> None:
        async with gate:
            start = time.perf_counter()
            await js.publish(f"{stream}.{i}", PAYLOAD)
            acked.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    wall = time.perf_counter() - start
    await nc.close()
    return count / wall, acked


def jetstream_alone(policy: str, root: Path, count: int) -> dict:
    config = root / f"{policy}.conf"
    config.write_text(nats_server_config(policy))
    server = start_nats(root / f"store-{policy}", config=config)
    try:
        row = {}
        for in_flight in (1, 32):
            rate, acked = asyncio.run(_publishes(server.url, count, in_flight))
            row[in_flight] = (rate, percentile(acked, 50), percentile(acked, 99))
        return row
    finally:
        server.stop()


def arena_up(policy: str, root: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    state = root / f"arena-{policy}"
    cmd = [sys.executable, "-m", "infra.cli", "up", "--port", str(port), "--state-dir", str(state)]
    url = f"http://127.0.0.1:{port}"
    proc = ServerProcess(f"arena-{policy}", [*cmd, "--nats-sync", policy], f"{url}/readyz", root / f"{policy}.log")
    return proc.start(), url


async def _round(url: str, users: int, seconds: float, max_tokens: int) -> tuple[int, int, list[float], float]:
    """(answered, failed, latencies) of closed-loop users over `seconds`, and the wall time."""
    latencies: list[float] = []
    failed = 0
    end = time.perf_counter() + seconds

    async def user(client: httpx.AsyncClient, u: int) -> None:
        nonlocal failed
        i = 0
        while time.perf_counter() < end:
            body = {
                "model": "stories-260k",
                "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": f"Tom and Sue {u} {i}"}],
            }
            start = time.perf_counter()
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - start)
            else:
                failed += 1
            i += 1

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=users)) as client:
        await asyncio.gather(*(user(client, u) for u in range(users)))
    return len(latencies), failed, latencies, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="always,2m", help="comma-separated: always and/or durations")
    p.add_argument("--publishes", type=int, default=2000, help="JetStream-alone publishes per policy and depth")
    p.add_argument("--users", default="8,32", help="closed-loop users at the gateway: comma-separated load levels")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="rounds per policy, alternating")
    p.add_argument("--round-s", type=float, default=15.0)
    args = p.parse_args(argv)
    policies = [nats_sync(x.strip()) for x in args.policies.split(",")]
    levels = [int(x) for x in args.users.split(",")]
    install_cleanup()
    with tempfile.TemporaryDirectory(prefix="sync-policy-") as tmp:
        root = Path(tmp)
        alone = {policy: jetstream_alone(policy, root, args.publishes) for policy in policies}
        stacks = {policy: arena_up(policy, root) for policy in policies}
        try:
            for proc, _ in stacks.values():
                proc.wait_ready(300)
            for _, url in stacks.values():  # a first request loads what the first turn needs
                httpx.post(
                    f"{url}/v1/chat/completions",
                    json={"model": "stories-260k", "messages": [{"role": "user", "content": "Hi"}]},
                    timeout=60,
                )
            served: dict[tuple[int, str], list] = {(u, policy): [0, 0, [], 0.0] for u in levels for policy in policies}
            for users in levels:
                for r in range(args.rounds):
                    for policy in policies if r % 2 == 0 else reversed(policies):
                        got = asyncio.run(_round(stacks[policy][1], users, args.round_s, args.max_tokens))
                        for i, value in enumerate(got):
                            served[users, policy][i] += value
        finally:
            for proc, _ in stacks.values():
                proc.stop()
    print(f"\nJetStream alone ({args.publishes} publishes of {len(PAYLOAD)} B each; ack P50/P99 in ms)")
    print(
        f"{'sync':>8} | {'1 in flight: pub/s':>18} {'P50':>6} {'P99':>6} | {'32 in flight: pub/s':>19} {'P50':>6} P99"
    )
    for policy, row in alone.items():
        cells = [f"{rate:>18,.0f} {p50 * 1e3:>6.2f} {p99 * 1e3:>6.2f}" for rate, p50, p99 in row.values()]
        print(f"{policy:>8} | {cells[0]} | {' ' + cells[1]}")
    print(
        f"\nThe gateway (arena up, closed-loop users, max_tokens {args.max_tokens}, "
        f"{args.rounds} x {args.round_s:.0f} s per policy and load, alternating; latency in ms)"
    )
    print(f"{'users':>5} {'sync':>8} | {'requests/s':>10} {'P50':>7} {'P99':>7} {'answered':>9} {'failed':>7}")
    for (users, policy), (answered, failed, latencies, wall) in served.items():
        p50, p99 = percentile(latencies, 50) or 0.0, percentile(latencies, 99) or 0.0
        line = f"{answered / wall:>10.1f} {p50 * 1e3:>7.0f} {p99 * 1e3:>7.0f} {answered:>9} {failed:>7}"
        print(f"{users:>5} {policy:>8} | {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
