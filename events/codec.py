"""Encoding and decoding events, with upcasting of older schema versions."""

from __future__ import annotations

from collections.abc import Callable

import orjson

from events.models import EVENT_TYPES, EventBase, Terminal, unused_additions

# (type, from_version) -> function turning that version's dict into the next version's.
UPCASTERS: dict[tuple[str, int], Callable[[dict], dict]] = {}


def upcast(data: dict) -> dict:
    while (step := UPCASTERS.get((str(data.get("type")), int(data.get("schema_version", 1))))) is not None:
        data = step(dict(data))
    return data


def register(cls: type[EventBase]) -> type[EventBase]:
    """Add an event model to the decodable types (a class decorator)."""
    EVENT_TYPES[cls.type_name()] = cls
    return cls


def decode(raw: bytes | str | dict) -> EventBase:
    """The event model named by the data's `type`, upcast to the current schema version.

    Raises ValueError for data that is no known event. Data of the current version is
    validated from its JSON text directly (pydantic-core's parser, faster than the json
    module and a dict: every chunk on the token path is decoded once or more)."""
    try:
        data = raw if isinstance(raw, dict) else orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError("an event is a JSON object")
    upcast_data = upcast(data)
    cls = EVENT_TYPES.get(upcast_data.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown event type {upcast_data.get('type')!r}")
    if upcast_data is data and not isinstance(raw, dict):
        return cls.model_validate_json(raw)
    return cls.model_validate(upcast_data)


def decode_terminal(raw: bytes | str) -> Terminal:
    """A stored result: its request's terminal event; ValueError for any other event."""
    event = decode(raw)
    if not isinstance(event, Terminal):
        raise ValueError(f"a result is a terminal event, not {event.type!r}")
    return event


def encode(event: EventBase) -> bytes:
    """The event's JSON, less additive fields it does not use (`events.models.Additive`)."""
    return event.model_dump_json(exclude=unused_additions(event) or None).encode()
