"""The published OpenAPI document says what the checks accept: each value below is valid by
the served document exactly when the gateway accepts it (what schemathesis' positive and
negative data checks ask, tests/e2e/test_edge_api.py, on the real stack)."""

from __future__ import annotations

import jsonschema
import pytest

from gateway.app import build_app, openapi
from gateway.served_schema import with_served_limits
from tests.unit.fake_pipeline import FakePipeline, chat, gateway, settings

MESSAGES = [{"role": "user", "content": "Once upon a time"}]


def _resolved(doc: dict, name: str) -> dict:
    """The request model's schema with its references resolvable (the document's components)."""
    return {**doc["components"]["schemas"][name], "components": doc["components"]}


def _schema_accepts(doc: dict, name: str, body: dict) -> bool:
    return jsonschema.Draft202012Validator(_resolved(doc, name)).is_valid(body)


@pytest.mark.parametrize(
    "path,name,field,values",
    [
        ("/v1/chat/completions", "ChatCompletionRequest", "function_call", [None, "none", "auto", {}, True, 0]),
        ("/v1/chat/completions", "ChatCompletionRequest", "tools", [None, [], [{"type": "function"}], False, 0]),
        (
            "/v1/chat/completions",
            "ChatCompletionRequest",
            "response_format",
            [None, {"type": "text"}, {"type": "json_object"}, "text"],
        ),
        ("/v1/completions", "CompletionRequest", "best_of", [None, 1, 1.0, 2, True, {}]),
        ("/v1/completions", "CompletionRequest", "echo", [None, False, True, 0]),
        ("/v1/completions", "CompletionRequest", "suffix", [None, "", "x", 0]),
    ],
)
def test_an_unserved_field_is_valid_exactly_when_it_is_accepted(path, name, field, values):
    client, _ = gateway()
    with client:
        doc = client.get("/openapi.json").json()
        for value in values:
            body = {"messages": MESSAGES} if name == "ChatCompletionRequest" else {"prompt": "Once upon a time"}
            body |= {field: value, "max_tokens": 2}
            accepted = client.post(path, json=body).status_code == 200
            assert _schema_accepts(doc, name, body) == accepted, (field, value)


def test_top_logprobs_needs_logprobs_in_the_schema_as_in_the_check():
    client, _ = gateway()
    with client:
        doc = client.get("/openapi.json").json()
        for extra in ({"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": True}, {"top_logprobs": 0}, {}):
            body = chat(max_tokens=2, **extra)
            accepted = client.post("/v1/chat/completions", json=body).status_code == 200
            assert _schema_accepts(doc, "ChatCompletionRequest", body) == accepted, extra


def test_the_served_limits_are_the_named_models_context_and_the_admission_overhead():
    s = settings(admission_overhead_s=0.5)
    doc = openapi(build_app(s, FakePipeline(s)))
    contexts = {"stories-260k": 512, "smollm2-135m": 8192}

    def valid(default: str, name: str, body: dict) -> bool:
        return _schema_accepts(with_served_limits(doc, 0.5, contexts, default), name, body)

    for name, base in (("ChatCompletionRequest", {"messages": MESSAGES}), ("CompletionRequest", {"prompt": "x"})):
        small = base | {"model": "stories-260k"}
        assert valid("smollm2-135m", name, small | {"max_tokens": 511})
        assert not valid("smollm2-135m", name, small | {"max_tokens": 512})  # the model's context: refused
        assert valid("smollm2-135m", name, base | {"model": "smollm2-135m", "max_tokens": 4096})  # the static bound
        assert valid("smollm2-135m", name, base | {"max_tokens": 4096})  # no model named: the default's
        assert not valid("stories-260k", name, base | {"max_tokens": 600})
        assert not valid("stories-260k", name, base | {"model": None, "max_tokens": 600})
        assert _schema_accepts(doc, name, small | {"max_tokens": 4096})  # no context known yet: the static bound
    assert not valid("smollm2-135m", "ChatCompletionRequest", small | {"max_completion_tokens": 512})
    assert valid("smollm2-135m", "TurnRequest", {"prompt": "hi", "max_tokens": 511})  # an arena turn: the smallest
    assert not valid("smollm2-135m", "TurnRequest", {"prompt": "hi", "max_tokens": 512})
    assert not valid("smollm2-135m", "ChatCompletionRequest", {"messages": MESSAGES, "deadline_s": 5e-324})
    assert valid("smollm2-135m", "ChatCompletionRequest", {"messages": MESSAGES, "deadline_s": 0.5})


def test_a_named_model_past_its_context_is_refused_as_the_document_says():
    """The same limit in the document and in the check (gateway/serving.py), on the fake fleet."""
    client, pipeline = gateway()
    with client:
        contexts = {m: 512 for m in pipeline.fleet().models}
        pipeline.context_len = contexts.get  # what the workers report
        served = client.get("/openapi.json").json()  # the document as served now
        for tokens in (511, 512):
            body = chat(model="stories-260k", max_tokens=tokens)
            accepted = client.post("/v1/chat/completions", json=body).status_code == 200
            assert _schema_accepts(served, "ChatCompletionRequest", body) == accepted, tokens


def test_a_deadline_under_the_admission_overhead_is_refused_as_the_schema_says():
    client, _ = gateway(admission_overhead_s=0.5)
    with client:
        for deadline, valid in ((5e-324, False), (0.4, False), (0.5, True), (30.0, True)):
            r = client.post("/v1/chat/completions", json=chat(max_tokens=2, deadline_s=deadline))
            assert (r.status_code == 200) == valid, (deadline, r.text)


def test_the_leaderboard_query_says_style_control_and_category_do_not_go_together():
    client, _ = gateway()
    with client:
        doc = client.get("/openapi.json").json()
        (query,) = [p for p in doc["paths"]["/arena/leaderboard"]["get"]["parameters"] if p["in"] == "query"]
        assert query["style"] == "form" and query["explode"] is True
        validator = jsonschema.Draft202012Validator(query["schema"])
        for params in (
            {"style_control": True},
            {"category": "coding"},
            {"category": "coding", "style_control": False},
            {"style_control": True, "category": "coding"},
            {"format": "csv"},
        ):
            code = client.get("/arena/leaderboard", params=params).status_code
            assert code in (200, 400) and validator.is_valid(params) == (code == 200), params
