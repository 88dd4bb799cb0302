"""One bad request among concurrent streams, through the whole stack (issue 10).

On main, ``top_p: 1e-300`` passed validation, underflowed to 0 in the sampler and raised;
the worker then failed every stream in the batch with a 500, the request itself never got
a terminal event, and the worker kept holding its job.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import nats
import pytest

from events import subjects
from events.fleet import InferenceBeat, decode_beat
from infra.audit import audit
from runtime.stream import read_events
from tests.conftest import STORY_PROMPTS as PROMPTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CHAT = "/v1/chat/completions"


def body(content: str, **kw) -> dict:
    return {"model": "stories-260k", "messages": [{"role": "user", "content": content}], "deadline_s": 60, **kw}


async def stream(client: httpx.AsyncClient, url: str, payload: dict) -> tuple[int, str, str | None]:
    """Status, streamed text and finish reason of one streaming request."""
    text, finish = "", None
    async with client.stream("POST", url + CHAT, json={**payload, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.text, None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            for choice in data.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    return 200, text, finish


async def streams(url: str, payloads: list[dict]) -> list[tuple[int, str, str | None]]:
    async with httpx.AsyncClient(timeout=90) as client:
        return await asyncio.gather(*(stream(client, url, p) for p in payloads))


def eight() -> list[dict]:
    return [body(p, temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=32) for i, p in enumerate(PROMPTS)]


async def stored_audit(nats_url: str) -> dict:
    nc = await nats.connect(nats_url)
    try:
        return audit(await read_events(nc.jetstream(), "arena.>"))
    finally:
        await nc.close()


async def inference_jobs(nats_url: str, timeout: float = 10.0) -> int:
    """Jobs the inference worker holds, from its next heartbeat."""
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(subjects.heartbeat_subject("inference", "*"))
        msg = await sub.next_msg(timeout=timeout)
        beat = decode_beat(msg.data)
        assert isinstance(beat, InferenceBeat)
        return beat.jobs
    finally:
        await nc.close()


def test_poison_among_eight_streams_hurts_no_one_and_the_audit_is_clean(stack):
    alone = asyncio.run(streams(stack.url, eight()))
    assert all(status == 200 for status, _, _ in alone), alone

    poison = body("Once upon a time", temperature=1.0, top_p=1e-300, seed=1, max_tokens=32)
    together = asyncio.run(streams(stack.url, [*eight()[:4], poison, *eight()[4:]]))
    assert [s for s, _, _ in together] == [200] * 9, together
    got_poison = together.pop(4)
    # The eight neighbours: complete, and the text each has alone.
    assert [t for _, t, _ in together] == [t for _, t, _ in alone]
    assert all(f in ("stop", "length") for _, _, f in together)
    # The former poison is served: a top_p below float32's range keeps only the top token.
    greedy = httpx.post(stack.url + CHAT, json=body("Once upon a time", temperature=0, max_tokens=32), timeout=60)
    assert got_poison[1] == greedy.json()["choices"][0]["message"]["content"]

    # A temperature the sampler cannot honour is refused up front, naming the field.
    for stream_it in (False, True):
        r = httpx.post(stack.url + CHAT, json=body("Hi", temperature=1e-300, stream=stream_it), timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "temperature"

    report = asyncio.run(stored_audit(stack.nats.url))
    assert report["ok"] and report["requests"] == 18 and not report["in_flight"], report
    assert asyncio.run(inference_jobs(stack.nats.url)) == 0
