"""Subject names, the stream and the durable consumers: the only place they are spelled.

Subjects are `arena.<stage>.<kind>.<conv_id>.<request_id>`, so one wildcard selects a
stage (a consumer's filter), a request (`arena.*.*.*.<request_id>`) or a conversation
(`arena.*.*.<conv_id>.*`) for replay. Live fan-out to gateways uses core NATS subjects
that are not stored.
"""

from __future__ import annotations

import hashlib
import re

from events.models import BattleEvent, EventBase, ModelEvent, RequestEvent

STREAM = "ARENA"
STREAM_SUBJECTS = ("arena.req.>", "arena.res.>", "arena.ctl.>", "arena.battle.>")

# kind -> subject stem
REQUESTED = "arena.req.requested"
ACCEPTED = "arena.req.accepted"
REJECTED = "arena.res.rejected"
TOKENS = "arena.res.tokens"
COMPLETED = "arena.res.completed"
FAILED = "arena.res.failed"
CANCELLED = "arena.ctl.cancelled"

STEM_BY_TYPE = {
    "chat.requested": REQUESTED,
    "prompt.accepted": ACCEPTED,
    "prompt.rejected": REJECTED,
    "tokens.generated": TOKENS,
    "chat.completed": COMPLETED,
    "chat.failed": FAILED,
    "chat.cancelled": CANCELLED,
}

# What each durable consumer reads (the consumers themselves are declared in events.topology).
FILTER_SUBJECT = f"{REQUESTED}.>"
INFERENCE_SUBJECT = f"{ACCEPTED}.>"
DELIVERY_SUBJECT = "arena.res.>"
#: Delivery's durable selects the terminal events among them (chunks go live from inference).
DELIVERY_FILTERS = (f"{REJECTED}.>", f"{COMPLETED}.>", f"{FAILED}.>")
CANCEL_SUBJECT = f"{CANCELLED}.>"
# Battle events: arena.battle.<kind>.<battle_id>.
BATTLE_PREFIX = "arena.battle"

LIVE_PREFIX = "arena.live"

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


def is_valid_token(value: str) -> bool:
    """Ids become subject tokens, so they may hold no dots, wildcards or spaces."""
    return bool(_TOKEN.match(value))


def subject_for(event: EventBase) -> str:
    stem = STEM_BY_TYPE[event.type]
    if isinstance(event, BattleEvent):
        return f"{stem}.{event.battle_id}"
    if isinstance(event, ModelEvent):
        return f"{stem}.{model_token(event.model)}"
    assert isinstance(event, RequestEvent), f"{type(event).__name__} is neither a request nor a battle event"
    return f"{stem}.{event.conv_id}.{event.request_id}"


def model_token(name: str) -> str:
    """A model's name as one subject token: itself when it is one, else its safe characters
    and a hash of the whole name ("llama-3.1" has a dot)."""
    if is_valid_token(name):
        return name
    safe = re.sub(r"[^A-Za-z0-9_\-]", "_", name)[:100]
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def request_filter(request_id: str) -> str:
    return f"arena.*.*.*.{request_id}"


def output_filter(request_id: str) -> str:
    """Every output event of a request: chunks and the terminal event."""
    return f"arena.res.*.*.{request_id}"


def conversation_filter(conv_id: str) -> str:
    return f"arena.*.*.{conv_id}.*"


def live_subject(request_id: str) -> str:
    """Core-NATS subject of a request's output for the gateways following it: chunks from
    the inference worker, terminal events from delivery (and from the worker)."""
    return f"{LIVE_PREFIX}.{request_id}"


def dedupe_key(event: EventBase) -> str:
    """Nats-Msg-Id for an event (see `EventBase.dedupe_key`)."""
    return event.dedupe_key()


# Core-NATS subject on which every consumer process announces itself (not stored).
HEARTBEAT_PREFIX = "arena.hb"


def heartbeat_subject(role: str, instance: str) -> str:
    return f"{HEARTBEAT_PREFIX}.{role}.{instance}"


# Core-NATS subject on which gateways tell each other what admission let through during a
# burst, and each its demand every second (gateway/admission/gate.py; not stored).
GATEWAY_ADMITTED = "arena.gw.admitted"

# Core-NATS request subject for hot swap: every inference process answers.
ADMIN_MODELS = "arena.admin.models"
