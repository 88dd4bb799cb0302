"""A conversation's next turn, read from its events in the stream (pure logic).

The conversation lives in the stream, not in a socket or a battle: a WebSocket turn
(gateway/ws.py) and each side of an arena battle (gateway/arena/serving.py) send the
model the last completed turn's messages, that turn's answer and the new user message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from events.models import ChatCompleted, ChatMessage, ChatRequested, EventBase, Failure


@dataclass
class Conversation:
    turn_id: int = 0
    attempt: int = 0
    messages: list[ChatMessage] = field(default_factory=list)


def conversation_state(events: list[EventBase]) -> Conversation:
    """The next turn of a conversation, from its events in stream order: its turn_id (the
    completed turns), the failed attempts at it, and the messages so far."""
    requested = {e.request_id: e for e in events if isinstance(e, ChatRequested)}
    failed = {e.request_id for e in events if isinstance(e, Failure)}
    last: ChatCompleted | None = None
    for e in events:
        if isinstance(e, ChatCompleted) and e.request_id in requested and (last is None or e.turn_id >= last.turn_id):
            last = e
    conv = Conversation()
    if last is not None:
        conv.turn_id = last.turn_id + 1
        conv.messages = messages_through(events, last.request_id)
    conv.attempt = sum(1 for r in requested.values() if r.turn_id == conv.turn_id and r.request_id in failed)
    return conv


def messages_through(events: list[EventBase], request_id: str) -> list[ChatMessage]:
    """The conversation as it stood once `request_id` completed: its messages and its
    answer (none when it did not complete). An arena side goes on from the last turn both
    sides answered, not from one only its own side finished."""
    requested = next((e for e in events if isinstance(e, ChatRequested) and e.request_id == request_id), None)
    answer = next((e for e in events if isinstance(e, ChatCompleted) and e.request_id == request_id), None)
    if requested is None or answer is None:
        return []
    return [*requested.messages, ChatMessage(role="assistant", content=answer.text)]
