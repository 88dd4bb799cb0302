"""Clients for the fault tests: concurrent streams and posts that record what a user sees."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
import nats

from infra.audit import audit_window
from runtime import jetstream


@dataclass
class Stream:
    status: int = 0
    content_type: str = ""
    text: str = ""
    done: bool = False
    error: dict | None = None
    request_id: str = ""
    chunk_times: list[float] = field(default_factory=list)


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    headers: dict | None = None,
    out: Stream | None = None,
    path: str = "/v1/chat/completions",
) -> Stream:
    """One streamed request (chat, or ``path`` /v1/completions); ``out`` (filled as chunks
    arrive) lets a caller watch it in flight."""
    out = out if out is not None else Stream()
    async with client.stream("POST", f"{url}{path}", json={**body, "stream": True}, headers=headers or {}) as r:
        out.status, out.content_type = r.status_code, r.headers.get("content-type", "")
        out.request_id = r.headers.get("x-request-id", "")
        if r.status_code != 200:
            await r.aread()
            out.error = r.json().get("error") if out.content_type.startswith("application/json") else None
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done = True
                break
            data = json.loads(line[6:])
            if "error" in data:
                out.error = data["error"]
            for choice in data.get("choices", []):
                if text := choice["delta"].get("content") if "delta" in choice else choice.get("text"):
                    out.text += text
                    out.chunk_times.append(time.monotonic())
    return out


async def post_one(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    try:
        return await client.post(f"{url}/v1/chat/completions", json=body, headers=headers or {})
    except httpx.HTTPError as exc:  # a transport failure is no status: record it as 0
        return httpx.Response(0, text=repr(exc))


def prompt(i: int, max_tokens: int = 200) -> dict:
    """A story request to stories-260k: fast enough that 40 of them at once end well inside
    the default deadline (`arena up`'s default model is a real chat model, ~20x slower)."""
    return {
        "model": "stories-260k",
        "messages": [{"role": "user", "content": f"Once upon a time, story number {i}"}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": 1000 + i,
    }


async def audit_of(nats_url: str, settle_s: float = 0.0) -> dict:
    await asyncio.sleep(settle_s)
    nc = await nats.connect(jetstream.servers(nats_url))
    try:
        return await audit_window(nc.jetstream(), timedelta(minutes=10))
    finally:
        await nc.close()
