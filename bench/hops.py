"""Where one user's request spends its time between the processes of `arena up`.

    python -m bench.hops --model ../shared/models/stories260K-hf --requests 20 --tokens 16

Starts `arena up` (continuous engine), listens to every event on its NATS server (core
subscription to `arena.>`: a stored publish reaches it as it reaches the stream), and
sends `--requests` non-streamed requests one after another. For each request it times,
by the listener's clock: the client's send, the gateway's ChatRequested, the filter's
PromptAccepted, the first chunk, the terminal event and the client's answer; with the
server-reported compute time, the hops outside the engine. Prints the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from itertools import pairwise
from pathlib import Path

import httpx
import nats

from bench import procs, targets
from bench.client import chat_body
from bench.stats import percentile
from events import decode
from events.models import TokensGenerated

STAGES = ("sent", "chat.requested", "prompt.accepted", "first chunk", "terminal", "answered")


def nats_url(state: Path) -> str:
    """The operator's URL that `arena up` writes in its state directory (as `arena` tools read it)."""
    return json.loads((state / "endpoints.json").read_text())["nats_url"]


async def run(base: str, url: str, model: str, requests: int, tokens: int) -> list[dict]:
    seen: dict[str, dict[str, float]] = {}

    async def on_msg(msg) -> None:
        now = time.perf_counter()
        if msg.subject.startswith("arena.hb"):
            return
        try:
            event = decode(msg.data)
        except ValueError:
            return
        rid = getattr(event, "request_id", None)
        if rid is None:
            return
        marks = seen.setdefault(rid, {})
        stage = "first chunk" if isinstance(event, TokensGenerated) else event.type
        if getattr(event, "terminal", False):
            stage = "terminal"
        marks.setdefault(stage, now)

    nc = await nats.connect(url)
    await nc.subscribe("arena.>", cb=on_msg)
    rows = []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
        for i in range(requests + 2):  # the first two warm up
            body = chat_body(model, [{"role": "user", "content": f"Once upon a time {i}"}], tokens, True)
            body["stream"] = False
            body.pop("stream_options")
            sent = time.perf_counter()
            resp = await client.post(f"{base}/v1/chat/completions", json=body)
            answered = time.perf_counter()
            data = resp.json()
            await asyncio.sleep(0.05)  # the listener's last events
            rid = data.get("id", "").removeprefix("chatcmpl-")
            marks = seen.get(rid) or next((m for k, m in seen.items() if rid and rid in k), {})
            compute = (data.get("x_arena") or {}).get("timings", {}).get("compute_s")
            if i >= 2 and all(s in marks for s in STAGES[1:5]) and compute is not None:
                rows.append({"sent": sent, **marks, "answered": answered, "compute": compute})
            await asyncio.sleep(0.2)
    await nc.close()
    return rows


def ms(values: list[float]) -> float:
    return 1e3 * (percentile(values, 50) or 0.0)


def report(rows: list[dict]) -> str:
    if not rows:
        return "no request was seen at every hop"
    lines = [f"{len(rows)} requests; medians (ms)", ""]
    for a, b in pairwise(STAGES):
        lines.append(f"{a:>16} -> {b:<16} {ms([r[b] - r[a] for r in rows]):7.1f}")
    total = [r["answered"] - r["sent"] for r in rows]
    outside = [r["answered"] - r["sent"] - r["compute"] for r in rows]
    lines.append(f"{'end to end':>36} {ms(total):7.1f}")
    lines.append(f"{'server compute':>36} {ms([r['compute'] for r in rows]):7.1f}")
    lines.append(f"{'overhead (e2e - compute)':>36} {ms(outside):7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--name", default="stories-260k")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/hops"))
    args = parser.parse_args(argv)
    procs.install_cleanup()
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    target = targets.prepare("arenaflow-continuous", targets.Setup(args.model, args.name, args.out, 8))
    with target.process as server:
        server.wait_ready(240)
        url = nats_url(args.out / "state" / "arenaflow-continuous")
        rows = asyncio.run(run(target.base_url, url, args.name, args.requests, args.tokens))
    print(report(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
