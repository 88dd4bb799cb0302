"""A token budget the model's context cannot hold is a 400 naming the field, with the
context length in the message, on every transport: never a 429 (that tells a client to
retry what can never succeed). stories260K's context is 512 tokens (its config's
max_position_embeddings), reported by the workers in their heartbeats: a budget of 512
or more is refused by the gateway at once; one that fits only without the prompt
("Once upon a time" is 5 tokens) is refused by the worker that tokenized it."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import websockets

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def stack(module_stack_factory):
    return module_stack_factory(ARENA_MODELS_CONFIG=REPO / "configs" / "stories-arena.yaml").start()


def assert_context_error(error: dict, field: str = "max_tokens") -> None:
    assert error["code"] == "context_length_exceeded" and error["param"] == field, error
    assert error["type"] == "invalid_request_error" and "512 tokens" in error["message"], error


def test_v1_over_the_context_is_a_400(stack):
    for body, field in (
        ({"max_tokens": 4096}, "max_tokens"),  # the gateway's check: the budget alone
        ({"max_tokens": 512}, "max_tokens"),
        ({"max_completion_tokens": 600}, "max_completion_tokens"),
        ({"max_tokens": 510}, "max_tokens"),  # the worker's: 5 prompt tokens + 510
    ):
        r = httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert_context_error(r.json()["error"], field)
    fits = httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 507}, timeout=60)
    assert fits.status_code == 200, fits.text


def test_the_async_api_over_the_context_is_a_400(stack):
    r = httpx.post(f"{stack.url}/chat", json={"prompt": PROMPT, "max_tokens": 4096}, timeout=10)
    assert r.status_code == 400, r.text
    assert_context_error(r.json()["error"])
    accepted = httpx.post(f"{stack.url}/chat", json={"prompt": PROMPT, "max_tokens": 510}, timeout=10)
    assert accepted.status_code == 202, accepted.text
    rid = accepted.json()["request_id"]
    end = time.monotonic() + 60
    while (result := httpx.get(f"{stack.url}/chat/result/{rid}", timeout=5)).status_code == 202:
        assert time.monotonic() < end, "still pending"
        time.sleep(0.1)
    assert result.status_code == 400 and result.json()["status"] == "failed", result.text
    assert_context_error(result.json()["error"])


async def test_a_websocket_turn_over_the_context_is_a_400_frame(stack):
    async with websockets.connect(stack.url.replace("http://", "ws://") + "/v1/ws") as sock:
        await asyncio.wait_for(sock.recv(), 30)  # the session frame
        for max_tokens in (4096, 510):
            await sock.send(json.dumps({"type": "turn", "content": PROMPT, "max_tokens": max_tokens}))
            frame = json.loads(await asyncio.wait_for(sock.recv(), 60))
            assert frame["type"] == "error" and frame["status"] == 400, frame
            assert_context_error(frame["error"])


def test_an_arena_turn_over_the_context_is_a_400(stack):
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        battle = client.post("/arena/battles").json()["battle_id"]
        r = client.post(f"/arena/battles/{battle}/turns", json={"prompt": PROMPT, "max_tokens": 4096})
        assert r.status_code == 400, r.text
        assert_context_error(r.json()["error"])


def test_a_request_over_the_kv_cache_budget_is_a_400(stack_factory):
    """A worker's KV cache budget (ARENA_KV_CACHE_MB) bounds a request as the context
    does: 0.1 MB holds 81 tokens of stories260K (1,280 bytes a token), so its heartbeats
    report 81, the gateway refuses a budget of 81 or more at once, and the worker refuses
    one that fits only without the prompt; one that fits is served. (Its own servers: the
    module's stack's workers would take its requests from a shared stream.)"""
    stack = stack_factory(ARENA_MODELS_CONFIG=REPO / "configs" / "stories-arena.yaml", ARENA_KV_CACHE_MB="0.1").start()
    for max_tokens in (100, 78):  # the gateway's check, then the worker's (5 + 78 > 81)
        r = httpx.post(
            f"{stack.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": max_tokens}, timeout=60
        )
        assert r.status_code == 400, (max_tokens, r.text)
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens", error
        assert "81 tokens" in error["message"], error
    fits = httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 70}, timeout=60)
    assert fits.status_code == 200, fits.text
