"""Pipeline overhead at low load: served latency minus the model's own compute.

One user sends the ceiling's first N requests in order, one after another, without
streaming (so the latency is the whole answer's); for each, overhead = end-to-end
latency - the batch-1 `generate` time that `bench.ceiling` measured in-process for the
same prompt and `max_tokens`. Where the server reports its own compute time
(arenaflow's `x_arena.timings.compute_s`), latency minus that is given as well: the
pipeline's own share, free of any difference between its model code and `generate`.

The same requests are then sent again streamed, for the overhead to the first token
(request in, first token out, minus the engine's own time): the client's time to the
first token minus the server-reported time from the request's start in the engine to
its first token (`ttft_s - queue_wait_s`: the engine thread's wake-up and the prefill
step). It leaves out what the end-to-end figure also counts after the last token (the
terminal event stored and fanned out, the answer's body).
"""

from __future__ import annotations

import time
from typing import Any

from bench.client import RequestRecord, chat_body, check_local, complete_chat, session, stream_chat
from bench.stats import percentile
from bench.workload import Turn


async def measure(
    base_url: str,
    model: str,
    turns: list[Turn],
    ignore_eos: bool = True,
    timeout_s: float = 120.0,
    stream: bool = False,
) -> list[RequestRecord]:
    """The requests, sequentially, over one connection pool (`stream`: as SSE, timing the first token)."""
    base = check_local(base_url)
    records = []
    async with session(timeout_s) as client:
        t0 = time.perf_counter()
        for index, turn in enumerate(turns):
            record = RequestRecord(session=index, turn=0, max_tokens=turn.max_tokens, start_s=0.0)
            body = chat_body(model, [{"role": "user", "content": turn.user_message}], turn.max_tokens, ignore_eos)
            send = stream_chat if stream else complete_chat
            records.append(await send(client, base, body, record, t0))
    return records


def overhead_row(records: list[RequestRecord], compute: list[dict]) -> dict:
    """P50/P99 of latency, compute and their difference, over the requests that succeeded."""
    pairs = [(r, c) for r, c in zip(records, compute, strict=False) if r.status == "ok"]
    if not pairs:
        errors = {r.error for r in records if r.error}
        return {"status": "failed", "reason": f"no request succeeded: {sorted(errors)[:2]}"}
    latency: list[float] = [r.latency_s or 0.0 for r, _ in pairs]  # ok records all have one
    comp = [c["compute_s"] for _, c in pairs]
    over = [lat - c for lat, c in zip(latency, comp, strict=True)]
    server = [
        (r.latency_s, r.timings["compute_s"]) for r, _ in pairs if r.timings and r.timings.get("compute_s") is not None
    ]
    row: dict[str, Any] = {"status": "ok", "requests": len(pairs), "failed": len(records) - len(pairs)}
    for label, values in (("latency", latency), ("compute", comp), ("overhead", over)):
        row[f"{label}_p50"] = percentile(values, 50)
        row[f"{label}_p99"] = percentile(values, 99)
    row["overhead_share_p50"] = percentile([o / lat for o, lat in zip(over, latency, strict=True)], 50)
    if server:
        row["server_compute_p50"] = percentile([c for _, c in server], 50)
        row["server_overhead_p50"] = percentile([lat - c for lat, c in server], 50)
        row["server_overhead_p99"] = percentile([lat - c for lat, c in server], 99)
    return row


def first_token_row(records: list[RequestRecord]) -> dict:
    """P50/P99 of the overhead to the first token over streamed requests whose server
    reported its timings (empty when none did)."""
    over = [
        r.ttft_s - (r.timings["ttft_s"] - r.timings["queue_wait_s"])
        for r in records
        if r.status == "ok" and r.ttft_s is not None and r.timings and r.timings.get("ttft_s") is not None
    ]
    if not over:
        return {}
    return {
        "first_token_requests": len(over),
        "first_token_ttft_p50": percentile([r.ttft_s for r in records if r.ttft_s is not None], 50),
        "first_token_overhead_p50": percentile(over, 50),
        "first_token_overhead_p99": percentile(over, 99),
    }
