"""OpenAI's surface beyond plain chat, with the real openai SDK against a real stack
(stories-260k; its engine in a process of its own, as by default): log probabilities on
chat (whole and streamed) and on completions, `POST /v1/completions`, penalties and
logit_bias in the sampler, and an idempotent retry answering the same log probabilities
from the stream."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import yaml
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import STORIES, stored_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "stories-260k"
USER = [{"role": "user", "content": "Once upon a time"}]
#: The same weights with a chat template of their own, so a chat's prompt is not a completion's.
TEMPLATED = "stories-templated"
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def api(module_stack_factory, tmp_path_factory):
    models = tmp_path_factory.mktemp("openai") / "models.yaml"
    entries = [
        {"name": MODEL, "path": str(STORIES)},
        {"name": TEMPLATED, "path": str(STORIES), "chat_template": TEMPLATE},
    ]
    models.write_text(yaml.safe_dump({"models": entries}))
    return module_stack_factory(ARENA_MODELS_CONFIG=models, ARENA_DEFAULT_MODEL=MODEL).start()


@pytest.fixture(scope="module")
def client(api):
    return OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _joined(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode()


def test_chat_logprobs_whole_and_streamed(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3, messages=USER
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12  # a story does not end in 12 tokens
    assert _joined(content) == r.choices[0].message.content  # the tokens' bytes make the text
    for e in content:
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert (e.token, e.logprob) == (e.top_logprobs[0].token, e.top_logprobs[0].logprob)  # greedy: the top one
    streamed = []
    for chunk in client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3, messages=USER, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=12, messages=USER)
    assert plain.choices[0].logprobs is None  # not asked: none
    assert plain.choices[0].message.content == r.choices[0].message.content


def test_an_idempotent_retry_returns_the_same_logprobs_and_the_stream_holds_them(api):
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 16,
        "temperature": 0.9,
        "logprobs": True,
        "top_logprobs": 2,
    }
    headers = {"Idempotency-Key": "logprobs-retry-1"}
    first = httpx.post(api.url + "/v1/chat/completions", json=body, headers=headers, timeout=60).json()
    again = httpx.post(api.url + "/v1/chat/completions", json=body, headers=headers, timeout=60).json()
    assert again["x_arena"]["attached"] and again["x_arena"]["request_id"] == first["x_arena"]["request_id"]
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    assert again["choices"][0]["logprobs"]["content"]
    chunks = [e for e in stored_events(api.nats.url, first["x_arena"]["request_id"]) if e.type == "tokens.generated"]
    stored = [lp.model_dump(mode="json") for c in chunks for lp in c.logprobs]
    assert stored == first["choices"][0]["logprobs"]["content"]  # what replay prints


def test_completions_whole_and_streamed_from_the_plain_prompt(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 10
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    assert r.usage.prompt_tokens == len(tokenizer("Once upon a time")["input_ids"])
    templated = client.completions.create(model=TEMPLATED, prompt="Once upon a time", max_tokens=2, temperature=0)
    chat = client.chat.completions.create(model=TEMPLATED, messages=USER, max_tokens=2, temperature=0)
    assert templated.usage.prompt_tokens == r.usage.prompt_tokens < chat.usage.prompt_tokens  # no template around it
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.token_logprobs) == 10
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and len(top) <= 3 and max(top.values()) == logprob  # greedy: the top one
    parts, finish = [], None
    for chunk in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True
    ):
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == choice.text and finish == "length"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=["Once", "upon"], max_tokens=4)
    assert refused.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="Once", max_tokens=4, echo=True)
    assert refused.value.body["param"] == "echo"


def test_penalties_change_the_output(client):
    def greedy(**kw) -> str:
        r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, messages=USER, **kw)
        return r.choices[0].message.content

    plain = greedy()
    freq, presence = greedy(frequency_penalty=2.0), greedy(presence_penalty=2.0)
    assert plain not in (freq, presence)
    words = plain.split()
    assert len(set(freq.split())) / len(freq.split()) > len(set(words)) / len(words)  # fewer repeats
    assert greedy(frequency_penalty=2.0) == freq  # still deterministic


def test_logit_bias_forces_a_token_and_one_outside_the_vocabulary_is_400(client):
    lily = AutoTokenizer.from_pretrained(STORIES).convert_tokens_to_ids("▁Lily")
    r = client.chat.completions.create(
        model=MODEL, temperature=1.0, seed=5, max_tokens=6, messages=USER, logit_bias={str(lily): 100}, logprobs=True
    )
    assert r.choices[0].message.content.split() == ["Lily"] * 6
    assert all(
        e.token == " Lily" and e.logprob <= 0 and math.isfinite(e.logprob) for e in r.choices[0].logprobs.content
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=USER, logit_bias={"100000": 5})
    assert refused.value.body["param"] == "logit_bias" and "vocabulary" in refused.value.body["message"]


def test_ignore_eos_reaches_the_engine_as_asked_and_a_wrong_type_is_400(api):
    """vLLM's and llama.cpp's `ignore_eos` (benchmarks send it for answers of a fixed
    length): carried on the request's event to the engine (the engine's part is
    tests/unit/test_engine.py's); a request without it is stored as before."""

    def requested(body: dict):
        r = httpx.post(api.url + "/v1/chat/completions", json=body, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length"
        events = stored_events(api.nats.url, r["x_arena"]["request_id"])
        [event] = [e for e in events if e.type == "chat.requested"]
        return event

    body = {"model": MODEL, "messages": USER, "max_tokens": 8, "temperature": 0}
    assert requested({**body, "ignore_eos": True}).params.ignore_eos is True
    assert requested(body).params.ignore_eos is False
    refused = httpx.post(api.url + "/v1/chat/completions", json={**body, "ignore_eos": "yes"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "ignore_eos"
