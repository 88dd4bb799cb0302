"""Encoding and decoding events, with upcasting of older schema versions."""

from __future__ import annotations

import json
from collections.abc import Callable

from pydantic import TypeAdapter

from events.models import Event

_adapter: TypeAdapter = TypeAdapter(Event)

# (type, from_version) -> function turning that version's dict into the next version's.
UPCASTERS: dict[tuple[str, int], Callable[[dict], dict]] = {}


def upcast(data: dict) -> dict:
    while (step := UPCASTERS.get((data.get("type"), data.get("schema_version", 1)))) is not None:
        data = step(dict(data))
    return data


def decode(raw: bytes | str | dict):
    data = raw if isinstance(raw, dict) else json.loads(raw)
    return _adapter.validate_python(upcast(data))


def encode(event) -> bytes:
    return event.model_dump_json().encode()
