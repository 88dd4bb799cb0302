"""The AsyncAPI document of the event contract, generated from `events/`.

Each stage's input is a subscriber and its outputs are publishers, typed by the event
models, so the document and the pydantic contract cannot drift apart.
"""

from __future__ import annotations

from faststream.nats import NatsBroker
from faststream.specification import AsyncAPI

from events import topology


def contract_broker() -> NatsBroker:
    """A broker holding one publisher per (role, event it publishes) and one subscriber
    per role that reads a durable consumer, from `events.topology`."""
    broker = NatsBroker()
    for role in topology.ROLES:
        for event, stem in role.publishes:
            broker.publisher(
                f"{stem}.{{conv_id}}.{{request_id}}",
                title=f"{role.name}:{event.__name__}",
                schema=event,
                description=(event.__doc__ or "").strip(),
            )
        if role.reads is None:
            continue
        consumed = role.consumes[0] if len(role.consumes) == 1 else None

        def handler(body):  # documentation only; the running handlers live in consumers/
            return None

        handler.__annotations__ = {"body": consumed or dict, "return": None}
        name = consumed.__name__ if consumed else "output events"
        broker.subscriber(role.reads, title=f"{role.name}:{name}", description=f"The {role.name} consumer's input.")(
            handler
        )
    return broker


def schema_json() -> str:
    spec = AsyncAPI(
        contract_broker(),
        title="arenaflow events",
        version="1",
        schema_version="3.0.0",
        description="Event contract of arenaflow's JetStream pipeline (stream ARENA).",
    )
    return spec.to_specification().to_json()
