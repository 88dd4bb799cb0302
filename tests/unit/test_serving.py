"""Pure pieces of the gateway's serving layer and the AsyncAPI document."""

from __future__ import annotations

import json

from events import topology
from events.models import ChatFailed, FilterReport, PromptRejected
from gateway.protocol import ChatCompletionRequest
from gateway.serving import body_hash
from gateway.session import answer_of, failure
from infra.asyncapi import schema_json


def req(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_body_hash_ignores_transport_options_only():
    base = body_hash(req(), "m")
    assert body_hash(req(stream=True, deadline_s=5, user="u"), "m") == base
    assert body_hash(req(temperature=0.5), "m") != base
    assert body_hash(req(), "other") != base


def test_failures_map_to_statuses():
    ids = dict(request_id="r", conv_id="c")
    assert failure(ChatFailed(**ids, code="deadline_exceeded", message="x")).status == 504
    assert failure(ChatFailed(**ids, code="cancelled", message="x")).status == 499
    rejected = failure(PromptRejected(**ids, reason="jailbreak", filter=FilterReport(action="reject")))
    assert (rejected.status, rejected.code, rejected.param) == (400, "prompt_rejected", "messages")
    assert answer_of(None).status == 504


def test_asyncapi_document_follows_the_topology():
    doc = json.loads(schema_json())
    channels = set(doc["channels"])
    for role in topology.ROLES:
        for event, _ in role.publishes:
            assert f"{role.name}:{event.__name__}" in channels
        if role.reads:
            assert any(c.startswith(f"{role.name}:") for c in channels)
    assert doc["asyncapi"].startswith("3.")
