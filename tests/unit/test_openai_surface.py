"""The OpenAI surface: fields served (logprobs, top_logprobs, penalties, logit_bias; their
values checked, a 400 naming the field out of range) and fields refused with a 400 naming
the field, never accepted and ignored (their neutral values pass); `POST /v1/completions`
and the response shapes with log probabilities; `GET /v1/models/{id}` (fake pipeline, no
servers; the openai SDK against the real stack is in tests/e2e/test_openai_api.py)."""

from __future__ import annotations

import json

import pytest

from gateway.protocol import COMPLETION_UNSERVED, UNSERVED
from tests.unit.fake_pipeline import chat, gateway

ASKED = {
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "tool_choice": "auto",
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
}


def test_every_unserved_field_is_listed_here():
    assert set(ASKED) == set(UNSERVED)


@pytest.mark.parametrize("field", sorted(ASKED))
def test_an_unserved_field_asking_for_something_is_400_naming_it(field):
    client, _ = gateway()
    with client:
        r = client.post("/v1/chat/completions", json=chat(**{field: ASKED[field]}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"], err


def test_neutral_values_of_the_unserved_fields_are_accepted():
    client, _ = gateway()
    neutral = {field: values[1] for field, values in UNSERVED.items()}
    with client:
        r = client.post("/v1/chat/completions", json=chat(max_tokens=8, **neutral))
        nulls = client.post("/v1/chat/completions", json=chat(max_tokens=8, **dict.fromkeys(UNSERVED)))
    assert r.status_code == 200 and nulls.status_code == 200, (r.text, nulls.text)


def test_retrieve_a_model_and_404_for_one_not_served():
    client, _ = gateway()
    with client:
        r = client.get("/v1/models/stories-260k")
        missing = client.get("/v1/models/no-such-model")
    assert r.status_code == 200 and r.json()["id"] == "stories-260k" and r.json()["object"] == "model"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"logprobs": 1}, "logprobs"),  # strict: a boolean
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"logit_bias": {"word": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"3": True}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ],
)
def test_served_fields_out_of_range_are_400_naming_them(fields, param):
    client, pipeline = gateway()
    with client:
        r = client.post("/v1/chat/completions", json=chat(**fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert not pipeline.requests()


def test_served_fields_reach_the_event():
    client, pipeline = gateway()
    fields = dict(logprobs=True, top_logprobs=3, presence_penalty=0.5, frequency_penalty=-1, logit_bias={"7": -100})
    with client:
        r = client.post("/v1/chat/completions", json=chat(max_tokens=8, **fields))
        plain = client.post("/v1/chat/completions", json=chat(max_tokens=8, logprobs=True))
    assert r.status_code == plain.status_code == 200, r.text
    first, second = pipeline.requests()
    p = first.params
    assert (p.logprobs, p.presence_penalty, p.frequency_penalty, p.logit_bias) == (3, 0.5, -1.0, ((7, -100.0),))
    assert second.params.logprobs == 0 and first.prompt_format == "chat"


def test_chat_logprobs_in_openais_shape_whole_and_streamed():
    client, _ = gateway()
    body = chat("abcdefgh", logprobs=True, top_logprobs=2)
    with client:
        whole = client.post("/v1/chat/completions", json=body).json()
        lines = client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
        none = client.post("/v1/chat/completions", json=chat("abcdefgh")).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["abcd", "efgh"]
    assert content[0] == {
        "token": "abcd",
        "logprob": -0.1,
        "bytes": list(b"abcd"),
        "top_logprobs": [
            {"token": "alt0", "logprob": 0.0, "bytes": list(b"alt0")},
            {"token": "alt1", "logprob": -1.0, "bytes": list(b"alt1")},
        ],
    }
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    streamed = [e for c in chunks if (lp := c["choices"][0]["logprobs"]) for e in lp["content"]]
    assert streamed == content
    assert none["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"echo": True}, "echo"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 2}, "best_of"),
        ({"n": 2}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
    ],
)
def test_completion_fields_refused_or_out_of_range_are_400_naming_them(fields, param):
    client, pipeline = gateway()
    with client:
        r = client.post("/v1/completions", json={"prompt": "Once upon", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert not pipeline.requests()


def test_neutral_values_of_the_completions_unserved_fields_are_accepted():
    client, _ = gateway()
    neutral = {field: values[1] for field, values in COMPLETION_UNSERVED.items()}
    with client:
        r = client.post("/v1/completions", json={"prompt": "Once", **neutral})
    assert r.status_code == 200, r.text


def test_a_completion_is_a_text_prompt_event_and_answers_in_openais_shape():
    client, pipeline = gateway()
    with client:
        r = client.post("/v1/completions", json={"prompt": "abcdefgh", "logprobs": 1, "stop": "zz", "seed": 4})
        streamed = client.post("/v1/completions", json={"prompt": "abcdefgh", "stream": True, "logprobs": 1})
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == "abcdefgh" and choice["finish_reason"] == "stop" and choice["index"] == 0
    assert choice["logprobs"] == {
        "tokens": ["abcd", "efgh"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"alt0": 0.0, "abcd": -0.1}, {"alt0": 0.0, "efgh": -0.2}],
        "text_offset": [0, 4],
    }
    event = pipeline.requests()[0]
    assert event.prompt_format == "text" and [m.role for m in event.messages] == ["user"]
    assert event.params.max_tokens == 16 and event.params.stop == ("zz",) and event.params.seed == 4
    lines = streamed.text.splitlines()
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcdefgh"
    offsets = [o for c in chunks if (lp := c["choices"][0]["logprobs"]) for o in lp["text_offset"]]
    assert offsets == [0, 4]  # counted across chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_completion_and_a_chat_of_the_same_text_are_different_requests_for_a_key():
    client, _ = gateway()
    headers = {"Idempotency-Key": "same"}
    with client:
        first = client.post("/v1/completions", json={"prompt": "hello"}, headers=headers)
        again = client.post("/v1/completions", json={"prompt": "hello"}, headers=headers)
        chat_turn = client.post("/v1/chat/completions", json=chat("hello", max_tokens=16), headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.json()["x_arena"]["attached"]
    assert chat_turn.status_code == 409
