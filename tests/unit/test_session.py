"""The request session every transport serves through (gateway/session.py), against the
fake pipeline: what its exit does when the output ran to its end, and when the client
left first."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from events.models import ChatCancelled, ChatFailed
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest
from gateway.serving import ChatService
from gateway.session import failure, keep_running
from tests.unit.fake_pipeline import FakePipeline, settings

MODEL = "stories-260k"


def service(**overrides) -> tuple[ChatService, FakePipeline]:
    s = settings(**overrides)
    pipeline = FakePipeline(s, chunk_chars=2)
    return ChatService(s, pipeline), pipeline


def request(content: str = "Once upon a time", **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": content}], stream=True, **fields)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


def answered(status: str) -> float:
    return sample("arena_req_total", status=status)


def cancels(pipeline: FakePipeline) -> list[str]:
    return [e.request_id for e in pipeline.published if isinstance(e, ChatCancelled)]


async def test_a_session_run_to_its_end_records_once_and_gives_back_its_place():
    chat, pipeline = service()
    before = answered("200")
    ticket, event = await chat.admit(request(), None, "anonymous")
    assert chat.admission.in_flight[MODEL] == 1
    session = await chat.start(ticket, event)
    async with session:
        text = "".join([chunk.text async for chunk in session])
        assert session.terminal.text == text == "Once upon a time" and session.error is None
    await session.close()  # a second close does nothing
    assert answered("200") == before + 1
    assert chat.admission.in_flight[MODEL] == 0 and cancels(pipeline) == []


async def test_a_client_leaving_mid_stream_stops_the_request_once():
    chat, pipeline = service()
    before = answered("200")
    ticket, event = await chat.admit(request(), None, "anonymous")
    session = await chat.start(ticket, event)
    async with session:
        async for _ in session:
            break  # the client went away after its first chunk
    await session.close()
    assert cancels(pipeline) == [ticket.request_id]
    assert chat.admission.in_flight[MODEL] == 0
    assert answered("200") == before  # no outcome: nobody got one


async def test_an_attached_client_leaving_leaves_the_earlier_request_running():
    chat, pipeline = service()
    first, event = await chat.admit(request(), "same-key", "anonymous")
    async with await chat.start(first, event) as session:
        await session.finish()
    again, none = await chat.admit(request(), "same-key", "anonymous")
    assert none is None and again.attached and again.request_id == first.request_id
    async with await chat.start(again, None) as session:
        async for _ in session:
            break
    assert cancels(pipeline) == []


async def test_a_request_nobody_follows_runs_on_when_its_session_closes_early():
    chat, pipeline = service()
    pipeline.silent = True  # no answer yet
    ticket, event = await chat.admit(request(), None, "anonymous")
    session = await chat.start(ticket, event, leave=keep_running)
    await session.close()
    assert cancels(pipeline) == [] and chat.admission.in_flight[MODEL] == 0


async def test_a_failed_publish_gives_back_the_place_and_the_key():
    chat, pipeline = service()
    pipeline.fail_publish = True
    ticket, event = await chat.admit(request(), "retry-me", "anonymous")
    with pytest.raises(APIError) as refused:
        await chat.start(ticket, event)
    assert refused.value.status == 503
    assert chat.admission.in_flight[MODEL] == 0
    pipeline.fail_publish = False
    retry, event = await chat.admit(request(), "retry-me", "anonymous")
    assert event is not None and not retry.attached  # the key was unbound: the retry runs


async def test_time_to_first_token_is_observed_for_a_streamed_session():
    chat, _ = service()
    count = sample("arena_time_to_first_token_seconds_count")
    ticket, event = await chat.admit(request(), None, "anonymous")
    async with await chat.start(ticket, event) as session:
        async for _ in session:
            pass
    assert sample("arena_time_to_first_token_seconds_count") == count + 1


def test_an_overloaded_workers_refusal_says_when_to_retry():
    """A worker that pulled a request too late to finish it says when it expects room: the
    client's Retry-After (the openai client waits that long before its retry), where a
    fixed second had the client's two retries refused the same way. A refusal stored
    before the field existed still reads, with 1 s."""
    said = ChatFailed(request_id="r1", conv_id="c1", code="overloaded", message="retry in 7 s", retry_after_s=7)
    assert (failure(said).status, failure(said).headers) == (429, {"Retry-After": "7"})
    old = ChatFailed.model_validate_json('{"request_id": "r2", "conv_id": "c2", "code": "overloaded", "message": "x"}')
    assert failure(old).headers == {"Retry-After": "1"}
