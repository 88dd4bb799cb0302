import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import ValidationError

from events import codec, decode, encode, subjects
from events.models import (
    EVENT_TYPES,
    FAILURE_TYPES,
    TERMINAL_TYPES,
    BattleEvent,
    ChatCompleted,
    ChatFailed,
    ChatMessage,
    ChatRequested,
    RequestEvent,
    SamplingParams,
    Timings,
    TokenLogprob,
    TokensGenerated,
    TopLogprob,
    Usage,
)


def requested(**kw):
    base = dict(
        request_id="r1",
        conv_id="c1",
        model="m",
        messages=[ChatMessage(role="user", content="hi")],
        params=SamplingParams(seed=3),
        deadline_at=10.0,
    )
    return ChatRequested(**{**base, **kw})


def test_round_trip_through_the_codec():
    e = requested()
    assert decode(encode(e)) == e


def test_events_are_frozen():
    with pytest.raises(ValidationError):
        requested().model = "other"


def test_subjects_select_a_request_and_a_conversation():
    e = requested()
    assert subjects.subject_for(e) == "arena.req.requested.c1.r1"
    assert subjects.request_filter("r1") == "arena.*.*.*.r1"
    assert subjects.conversation_filter("c1") == "arena.*.*.c1.*"


def test_one_dedupe_key_for_every_terminal_event_of_a_request():
    done = ChatCompleted(
        request_id="r1",
        conv_id="c1",
        model="m",
        text="x",
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        timings=Timings(queue_wait_s=0, ttft_s=0, decode_s=0, compute_s=0),
        chunks=1,
    )
    failed = ChatFailed(request_id="r1", conv_id="c1", code="cancelled", message="x")
    assert subjects.dedupe_key(done) == subjects.dedupe_key(failed) == "r1:terminal"
    chunk = TokensGenerated(request_id="r1", conv_id="c1", seq=2, text="a", token_ids=(1,), model="m")
    assert subjects.dedupe_key(chunk) == "r1:tok:2"


@pytest.mark.parametrize(
    "value,ok", [("abc-DEF_1", True), ("a.b", False), ("a b", False), ("*", False), ("", False), ("x" * 129, False)]
)
def test_ids_must_be_subject_tokens(value, ok):
    assert subjects.is_valid_token(value) is ok


def test_upcaster_runs_before_validation(monkeypatch):
    from events import codec

    current = requested()
    old = current.model_dump(mode="json")
    old["schema_version"] = 0
    old["prompt"] = old.pop("messages")  # a made-up v0 field name
    monkeypatch.setitem(
        codec.UPCASTERS,
        ("chat.requested", 0),
        lambda d: {**{k: v for k, v in d.items() if k != "prompt"}, "messages": d["prompt"], "schema_version": 1},
    )
    assert decode(old) == current


def test_events_written_by_version_1_still_decode():
    """tests/data/events-v1.jsonl was written by the contract before the base split
    (request fields on EventBase); every stored event must still decode, unchanged."""
    path = Path(__file__).resolve().parents[1] / "data" / "events-v1.jsonl"
    lines = path.read_text().splitlines()
    events = [decode(line) for line in lines]
    assert [e.type for e in events] == [
        "chat.requested",
        "prompt.accepted",
        "prompt.rejected",
        "tokens.generated",
        "chat.completed",
        "chat.failed",
        "chat.cancelled",
    ]
    for line, event in zip(lines, events, strict=True):
        assert _holds(json.loads(encode(event)), json.loads(line))  # fields added since may only be extra
        assert isinstance(event, RequestEvent)


def _holds(new: object, old: object) -> bool:
    """Every field of `old` is in `new` with the same value (nested)."""
    if isinstance(old, dict):
        return isinstance(new, dict) and all(k in new and _holds(new[k], v) for k, v in old.items())
    return new == old


def test_unknown_types_and_non_objects_are_value_errors():
    with pytest.raises(ValueError):
        decode(b'{"type": "no.such.event"}')
    with pytest.raises(ValueError):
        decode(b"[1, 2]")


def _rename_pick(data: dict) -> dict:
    out = {k: v for k, v in data.items() if k != "pick"}
    return {**out, "choice": data["pick"], "schema_version": 2}


def test_a_battle_event_family_needs_no_request_ids(monkeypatch):
    class ToyVoted(BattleEvent):
        """A made-up battle event, to show the family works without request ids."""

        type: Literal["toy.voted"] = "toy.voted"
        choice: str
        schema_version: int = 2

    monkeypatch.setitem(subjects.STEM_BY_TYPE, "toy.voted", f"{subjects.BATTLE_PREFIX}.toyvoted")
    monkeypatch.setitem(codec.UPCASTERS, ("toy.voted", 1), _rename_pick)
    codec.register(ToyVoted)
    try:
        vote = ToyVoted(battle_id="b1", choice="a")
        assert subjects.subject_for(vote) == "arena.battle.toyvoted.b1"
        assert subjects.dedupe_key(vote) == "battle:b1:toy.voted"  # one per battle
        assert decode(encode(vote)) == vote
        old = {**vote.model_dump(mode="json", exclude={"choice"}), "pick": "a", "schema_version": 1}
        assert decode(old) == vote  # the upcast machinery serves both families
        assert "request_id" not in vote.model_dump()
    finally:
        EVENT_TYPES.pop("toy.voted")


def test_terminal_types_come_from_the_models():
    assert {"chat.completed", "chat.failed", "prompt.rejected"} == TERMINAL_TYPES
    assert {"chat.failed", "prompt.rejected"} == FAILURE_TYPES
    # The union (what mypy and isinstance see) and the models' `terminal` flag agree.
    assert {name for name, cls in EVENT_TYPES.items() if cls.terminal} == TERMINAL_TYPES


def test_additive_fields_are_written_only_when_used():
    """Events that use none of the fields added since v1 (prompt_format, the penalties,
    logit_bias, logprobs) are written with v1's keys exactly, so a process still on v1's
    contract (extra="forbid") reads them during a rolling deploy; used, they round-trip."""
    path = Path(__file__).resolve().parents[1] / "data" / "events-v1.jsonl"
    v1 = {e["type"]: e for e in map(json.loads, path.read_text().splitlines())}
    plain = requested()
    chunk = TokensGenerated(request_id="r1", conv_id="c1", seq=0, text="a", token_ids=(1,), model="m")
    for event in (plain, chunk):
        written = json.loads(encode(event))
        assert set(written) <= set(v1[event.type]) | {"principal"}, set(written) - set(v1[event.type])
    assert set(json.loads(encode(plain))["params"]) == set(v1["chat.requested"]["params"])
    used = requested(
        prompt_format="text",
        params=SamplingParams(seed=3, presence_penalty=0.5, frequency_penalty=-1, logit_bias={7: -100}, logprobs=2),
    )
    entry = TokenLogprob(
        token="a", logprob=-0.5, bytes=(97,), top_logprobs=(TopLogprob(token="b", logprob=-1, bytes=(98,)),)
    )
    asked = chunk.model_copy(update={"logprobs": (entry,)})
    for event in (used, asked):
        assert decode(encode(event)) == event
    assert json.loads(encode(used))["params"]["logit_bias"] == {"7": -100.0}


def test_sampling_params_decode_the_stored_ranges_and_check_what_the_engine_serves():
    """A stored event decodes whatever the engine makes of it (the worker's intake fails a
    request it cannot serve): a temperature below MIN_TEMPERATURE, an empty stop string."""
    stored = SamplingParams.model_validate_json('{"temperature": 0.001, "stop": [""], "logit_bias": {"9": 1, "3": -2}}')
    assert stored.logit_bias == ((3, -2.0), (9, 1.0))  # held sorted, immutable: params are hashable
    assert hash(stored) == hash(stored.model_copy())
    for unservable in (stored, stored.model_copy(update={"temperature": 0.0})):
        with pytest.raises(ValueError):
            unservable.checked()
    assert SamplingParams(temperature=0).checked().greedy
