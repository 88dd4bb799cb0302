"""One streamed chat completion against an OpenAI-compatible server, timed.

Time to first token is the arrival of the first chunk with non-empty `delta.content`
(servers send a role-only chunk first; that is not a token). Output tokens come from
the final `usage` chunk when the server sends one (we ask with `stream_options`), else
from the count of content chunks, one token each for the servers measured here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Literal
from urllib.parse import urlsplit

import aiohttp
import orjson

Status = Literal["ok", "error", "rejected"]
LOCAL_HOSTS = ("127.0.0.1", "localhost")


@dataclass
class RequestRecord:
    """What one request measured; times in seconds from the run's start."""

    session: int
    turn: int
    max_tokens: int
    start_s: float
    status: Status = "error"
    http_status: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    output_tokens: int = 0
    tokens_from: Literal["usage", "chunks", "none"] = "none"
    error: str | None = None
    #: The `code` of the error the server answered with (its JSON body's, or its stream's error event's).
    error_code: str | None = None
    retry_after_s: float | None = None  # the refusal's Retry-After
    prompt_tokens: int | None = None  # from the final `usage` chunk
    text: str = ""
    timings: dict | None = None
    #: When each content chunk arrived, seconds after the request was sent (streamed requests).
    chunk_s: list[float] = field(default_factory=list)

    def as_json(self) -> dict:
        row = asdict(self)
        row.pop("text")
        row.pop("chunk_s")
        return row


def check_local(base_url: str) -> str:
    """The base URL without a trailing slash; refuses anything but this machine."""
    host = urlsplit(base_url).hostname
    if host not in LOCAL_HOSTS:
        raise ValueError(f"base URL {base_url!r}: the benchmark only targets 127.0.0.1")
    return base_url.rstrip("/")


def chat_body(
    model: str,
    messages: list[dict],
    max_tokens: int,
    ignore_eos: bool = True,
    extra: dict | None = None,
    temperature: float = 0.0,
) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        # Not in OpenAI's API; servers that know it keep generating past EOS so
        # lengths stay as drawn, most others ignore it.
        body["ignore_eos"] = True
    return body | (extra or {})


def server_timings(body: dict) -> dict | None:
    """Timings a server reports about itself (arenaflow: `x_arena.timings`), if any."""
    usage = body.get("usage") or {}
    return (body.get("x_arena") or {}).get("timings") or body.get("x_arena_timings") or usage.get("x_arena_timings")


def session(timeout_s: float, connections: int = 100) -> aiohttp.ClientSession:
    """The benchmark's HTTP client: aiohttp, as vLLM's `benchmark_serving` uses. The load
    generator runs on the cores it measures, so its own CPU per token counts against
    every target alike; aiohttp reads a stream for less than half of httpx's CPU
    (36 against 87 µs a token, CHANGELOG.md, "Session 8")."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=timeout_s, connect=10.0),
        json_serialize=lambda obj: orjson.dumps(obj).decode(),
    )


CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ValueError)


#: How many times a request that never left is sent again (each on another connection).
WRITE_RETRIES = 8


@asynccontextmanager
async def post(client: aiohttp.ClientSession, url: str, body: dict) -> AsyncIterator[aiohttp.ClientResponse]:
    """POST ``body``, once more if it never left: aiohttp writes a request onto a pooled
    keep-alive connection the server may have closed meanwhile (llama-server does), and
    fails it with "Can not write request body" before the server saw a byte, which is no
    answer of the server's to count (it cost 30-48% of llama-server's requests)."""
    for attempt in range(WRITE_RETRIES + 1):
        try:
            resp = await client.post(url, json=body)
            break
        except aiohttp.ClientOSError as exc:
            # No connection at all is the server's trouble; each retry takes the pool's next
            # connection (several may have been closed at once) or a new one.
            if isinstance(exc, aiohttp.ClientConnectorError) or attempt == WRITE_RETRIES:
                raise
    async with resp:
        yield resp


async def complete_chat(
    client: aiohttp.ClientSession, base_url: str, body: dict, record: RequestRecord, t0: float
) -> RequestRecord:
    """Like `stream_chat` without streaming: one JSON answer, so no TTFT."""
    body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    sent = time.perf_counter()
    record.start_s = sent - t0
    try:
        async with post(client, f"{base_url}/v1/chat/completions", body) as resp:
            record.http_status = resp.status
            raw = await resp.read()
        if resp.status != 200:
            return refused(record, resp, raw)
        answer = orjson.loads(raw)
    except CLIENT_ERRORS as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return record
    record.latency_s = time.perf_counter() - sent
    record.text = answer["choices"][0]["message"]["content"] or ""
    record.output_tokens = int((answer.get("usage") or {}).get("completion_tokens") or 0)
    record.tokens_from = "usage" if answer.get("usage") else "none"
    record.timings = server_timings(answer)
    record.status = "ok"
    return record


def refused(record: RequestRecord, resp: aiohttp.ClientResponse, raw: bytes) -> RequestRecord:
    """``record`` of a request the server answered with an error status: the status, its
    body's first 200 characters, its error `code` and `Retry-After` when it gave them."""
    record.status = "rejected" if resp.status == 429 else "error"
    record.error = f"HTTP {resp.status}: {raw[:200].decode(errors='replace')}"
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):  # no error body of OpenAI's shape
        record.error_code = orjson.loads(raw)["error"].get("code")
    if (after := resp.headers.get("Retry-After")) is not None:
        with contextlib.suppress(ValueError):
            record.retry_after_s = float(after)
    return record


async def stream_chat(
    client: aiohttp.ClientSession, base_url: str, body: dict, record: RequestRecord, t0: float
) -> RequestRecord:
    """Send `body`, fill `record` in place and return it; never raises for HTTP trouble."""
    sent = time.perf_counter()
    record.start_s = sent - t0
    try:
        async with post(client, f"{base_url}/v1/chat/completions", body) as resp:
            record.http_status = resp.status
            if resp.status != 200:
                return refused(record, resp, await resp.read())
            record.error = await _read_events(resp, record, sent)
    except CLIENT_ERRORS as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:200]
    if record.error is None:
        record.latency_s = time.perf_counter() - sent
        record.status = "ok"
    return record


async def _read_events(resp: aiohttp.ClientResponse, record: RequestRecord, sent: float) -> str | None:
    """Consume the SSE stream into `record`; returns the error event's text, if one came."""
    parts: list[str] = []
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = orjson.loads(data)
        if error := event.get("error"):
            record.error_code = error.get("code") if isinstance(error, dict) else None
            return str(error)[:200]
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                record.chunk_s.append(time.perf_counter() - sent)
                if record.ttft_s is None:
                    record.ttft_s = record.chunk_s[0]
                parts.append(content)
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            record.output_tokens = int(usage["completion_tokens"])
            record.tokens_from = "usage"
            record.prompt_tokens = usage.get("prompt_tokens")
        record.timings = server_timings(event) or record.timings
    record.text = "".join(parts)
    if record.tokens_from == "none" and parts:
        record.output_tokens, record.tokens_from = len(parts), "chunks"
    return None
