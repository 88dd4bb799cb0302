"""The OpenAI fields arenaflow does not serve are refused with a 400 naming the field,
never accepted and ignored; their neutral values pass. `GET /v1/models/{id}` (fake
pipeline, no servers; the openai SDK against the real stack is in tests/e2e/test_gateway_api.py)."""

from __future__ import annotations

import pytest

from gateway.protocol import UNSERVED
from tests.unit.test_gateway_routes import chat, client_for

ASKED = {
    "logprobs": True,
    "top_logprobs": 3,
    "presence_penalty": 0.5,
    "frequency_penalty": -1,
    "logit_bias": {"50256": -100},
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
    client, _ = client_for()
    with client:
        r = client.post("/v1/chat/completions", json=chat(**{field: ASKED[field]}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"], err


def test_neutral_values_of_the_unserved_fields_are_accepted():
    client, _ = client_for()
    neutral = {field: values[1] for field, values in UNSERVED.items()}
    with client:
        r = client.post("/v1/chat/completions", json=chat(max_tokens=8, **neutral))
        nulls = client.post("/v1/chat/completions", json=chat(max_tokens=8, **dict.fromkeys(UNSERVED)))
    assert r.status_code == 200 and nulls.status_code == 200, (r.text, nulls.text)


def test_retrieve_a_model_and_404_for_one_not_served():
    client, _ = client_for()
    with client:
        r = client.get("/v1/models/stories-260k")
        missing = client.get("/v1/models/no-such-model")
    assert r.status_code == 200 and r.json()["id"] == "stories-260k" and r.json()["object"] == "model"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
