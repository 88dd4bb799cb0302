"""The AsyncAPI document of the event contract, generated from `events/`.

Each stage's input is a subscriber and its outputs are publishers, typed by the event
models, so the document and the pydantic contract cannot drift apart.
"""

from __future__ import annotations

from faststream.nats import NatsBroker
from faststream.specification import AsyncAPI

from events import models as m
from events import subjects as s

# (stage, the event it consumes and its subject, [(event it publishes, subject)])
STAGES = [
    ("gateway", None, None, [(m.ChatRequested, s.REQUESTED), (m.ChatCancelled, s.CANCELLED)]),
    ("filter", m.ChatRequested, s.FILTER_SUBJECT, [(m.PromptAccepted, s.ACCEPTED), (m.PromptRejected, s.REJECTED)]),
    (
        "inference",
        m.PromptAccepted,
        s.INFERENCE_SUBJECT,
        [(m.TokensGenerated, s.TOKENS), (m.ChatCompleted, s.COMPLETED), (m.ChatFailed, s.FAILED)],
    ),
    ("delivery", None, s.DELIVERY_SUBJECT, []),
]


def contract_broker() -> NatsBroker:
    broker = NatsBroker()
    for stage, consumed, subject, produced in STAGES:
        for event, stem in produced:
            broker.publisher(
                f"{stem}.{{conv_id}}.{{request_id}}",
                title=f"{stage}:{event.__name__}",
                schema=event,
                description=(event.__doc__ or "").strip(),
            )
        if consumed is not None:

            def handler(body):  # documentation only; the running handlers live in consumers/
                return None

            handler.__annotations__ = {"body": consumed, "return": None}
            broker.subscriber(
                subject, title=f"{stage}:{consumed.__name__}", description=f"The {stage} consumer's input."
            )(handler)
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
