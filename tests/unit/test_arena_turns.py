"""A battle turn counts as one: a turn one side did not finish is no part of the battle
(gateway/arena/features.py, gateway/conversation.py; pure logic)."""

from __future__ import annotations

from events.models import ChatCompleted, ChatFailed, ChatMessage, ChatRequested, SamplingParams, Usage
from gateway.arena.features import answer_texts, style_of, whole_turns
from gateway.conversation import messages_through
from tests.unit.test_assembler_and_audit import done


def answered(rid: str, text: str, tokens: int) -> ChatCompleted:
    usage = Usage(prompt_tokens=1, completion_tokens=tokens, total_tokens=1 + tokens)
    return done(text, 1, rid).model_copy(update={"usage": usage})


def cut(rid: str) -> ChatFailed:
    return ChatFailed(request_id=rid, conv_id="c", code="deadline_exceeded", message="generation ended: deadline")


def asked(rid: str, turn: int, *contents: str) -> ChatRequested:
    messages = tuple(ChatMessage(role="user" if i % 2 == 0 else "assistant", content=c) for i, c in enumerate(contents))
    return ChatRequested(
        request_id=rid, conv_id="c", turn_id=turn, model="m", messages=messages, params=SamplingParams(), deadline_at=0
    )


def test_a_turn_one_side_did_not_finish_is_no_part_of_the_vote() -> None:
    # Turn 0 whole, turn 1 cut on side b (side a's answer is dropped with it), turn 2 whole.
    turns = [
        (answered("a0", "# One", 3), answered("b0", "plain", 2)),
        (answered("a1", "- lost\n- list", 50), cut("b1")),
        (answered("a2", "two", 4), answered("b2", "- x", 1)),
    ]
    assert [(a.request_id, b.request_id) for a, b in whole_turns(turns)] == [("a0", "b0"), ("a2", "b2")]
    assert answer_texts(turns) == {"a": ["# One", "two"], "b": ["plain", "- x"]}
    meta = style_of(turns)
    assert meta["turns"] == 2 and meta["sum_assistant_a_tokens"] == 7 and meta["sum_assistant_b_tokens"] == 3
    assert meta["list_count_a"]["unordered"] == 0 and meta["list_count_b"]["unordered"] == 1
    assert whole_turns([(answered("a", "x", 1), None)]) == []  # a side still running


def test_a_side_goes_on_from_the_turn_both_answered() -> None:
    events = [
        asked("r0", 0, "Once upon a time"),
        answered("r0", "there was a cat.", 5),
        asked("r1", 1, "Once upon a time", "there was a cat.", "Then?"),
        answered("r1", "It slept.", 3),  # this side finished turn 1; the other side was cut
    ]
    assert [m.content for m in messages_through(events, "r0")] == ["Once upon a time", "there was a cat."]
    assert messages_through(events, "r0")[-1].role == "assistant"
    assert len(messages_through(events, "r1")) == 4
    assert messages_through([asked("r2", 0, "Hi"), cut("r2")], "r2") == []  # not answered: nothing to go on from
    assert messages_through(events, "unknown") == []
