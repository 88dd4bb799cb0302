"""One chat request through all four processes to the real stories260K model."""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from consumers.inference.model_loading import default_specs, load_model, render_chat
from consumers.inference.settings import InferenceSettings
from infra.audit import audit
from runtime.stream import request_events
from tests.conftest import STORIES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

PROMPT = "Once upon a time, there was a little dog"


def reference_completion(messages, max_tokens: int) -> str:
    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    loaded = load_model(default_specs(InferenceSettings().models_dir)[0])
    text = render_chat(loaded, messages)
    ids = tok(text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
    # The completion is the text the new tokens add to the prompt's text (decoding the new
    # tokens alone would drop the leading space of a sentencepiece word).
    full = tok.decode(out[0], skip_special_tokens=True)
    prefix = tok.decode(ids["input_ids"][0], skip_special_tokens=True)
    assert full.startswith(prefix)
    return full[len(prefix) :]


def test_chat_completion_is_the_models_own_greedy_output(stack):
    messages = [{"role": "user", "content": PROMPT}]
    r = httpx.post(
        f"{stack.url}/v1/chat/completions",
        timeout=30,
        json={"model": "stories-260k", "messages": messages, "temperature": 0, "max_tokens": 40},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert text == reference_completion(messages, 40)
    assert body["usage"]["completion_tokens"] > 0
    assert body["choices"][0]["finish_reason"] in ("stop", "length")

    async def events():
        nc = await nats.connect(stack.nats.url)
        try:
            return await request_events(nc.jetstream(), body["x_arena"]["request_id"])
        finally:
            await nc.close()

    evs = asyncio.run(events())
    types = [e.type for e in evs]
    assert types[0] == "chat.requested" and types[1] == "prompt.accepted"
    assert types[-1] == "chat.completed"
    assert "".join(e.text for e in evs if e.type == "tokens.generated") == text
    assert audit(evs)["ok"]


def test_models_health_and_readiness(stack):
    assert httpx.get(f"{stack.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{stack.url}/readyz")
    assert ready.status_code == 200 and ready.json()["models"]["stories-260k"]
    ids = [m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]]
    assert ids == ["stories-260k"]
