"""An answer's text through every transport (JSON, SSE, WebSocket, the async API) and as
stored: one that ends on the model's end token carries no stray U+FFFD at its end (the
skipped end token once read as half a character).

stories260K ends a story with the BOS that starts the next one (llama2.c's run.c stops
there), not with its EOS: served from a copy whose generation config names both as end
tokens, its greedy answers end with finish_reason ``stop`` after 200-340 tokens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest
import websockets
import yaml

from tests.conftest import STORIES, stored_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROMPTS = ["The little cat", "One day, a bird", "The sun was hot"]
ASK = {"temperature": 0, "max_tokens": 400}


@pytest.fixture(scope="module")
def stack(module_stack_factory, tmp_path_factory):
    model = tmp_path_factory.mktemp("stories-ends")
    for f in STORIES.iterdir():
        shutil.copy(f, model / f.name)
    config = json.loads((STORIES / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, 1]}))
    models = model / "models.yaml"
    models.write_text(yaml.safe_dump({"models": [{"name": "stories-260k", "path": str(model)}]}))
    return module_stack_factory(ARENA_MODELS_CONFIG=models).start()


def chat(prompt: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], **ASK}


def assert_clean(text: str, finish_reason: str) -> None:
    assert finish_reason == "stop" and text, (finish_reason, text)
    assert not text.endswith("\ufffd"), repr(text[-20:])


def stored_text(stack, request_id: str) -> str:
    (done,) = [e for e in stored_events(stack.nats.url, request_id) if e.type == "chat.completed"]
    return done.text


def test_json_and_stored_answers_end_clean(stack):
    for prompt in PROMPTS:
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=chat(prompt), timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert_clean(choice["message"]["content"], choice["finish_reason"])
        assert stored_text(stack, r.headers["x-request-id"]) == choice["message"]["content"]


def test_sse_answers_end_clean(stack):
    for prompt in PROMPTS:
        parts, reason = [], None
        with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json={**chat(prompt), "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    parts.append(choice["delta"].get("content") or "")
                    reason = choice.get("finish_reason") or reason
        assert_clean("".join(parts), reason)


async def test_websocket_answers_end_clean(stack):
    for prompt in PROMPTS:  # a conversation each: a second turn's history would fill the context
        async with websockets.connect(stack.url.replace("http://", "ws://") + "/v1/ws") as sock:
            await asyncio.wait_for(sock.recv(), 30)  # the session frame
            await sock.send(json.dumps({"type": "turn", "content": prompt, **ASK}))
            chunks = []
            while (frame := json.loads(await asyncio.wait_for(sock.recv(), 60)))["type"] == "chunk":
                chunks.append(frame["text"])
            assert frame["type"] == "done", frame
            assert_clean(frame["text"], frame["finish_reason"])
            assert "".join(chunks) == frame["text"]


def test_async_api_answers_end_clean(stack):
    for prompt in PROMPTS:
        r = httpx.post(f"{stack.url}/chat", json={"prompt": prompt, **ASK}, timeout=10)
        assert r.status_code == 202, r.text
        rid = r.json()["request_id"]
        for _ in range(600):
            result = httpx.get(f"{stack.url}/chat/result/{rid}", timeout=5)
            if result.status_code != 202:
                break
            time.sleep(0.1)
        assert result.status_code == 200, result.text
        assert_clean(result.json()["text"], result.json()["finish_reason"])
