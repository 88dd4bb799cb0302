"""Subject names, the stream and the durable consumers: the only place they are spelled.

Subjects are `arena.<stage>.<kind>.<conv_id>.<request_id>`, so one wildcard selects a
stage (a consumer's filter), a request (`arena.*.*.*.<request_id>`) or a conversation
(`arena.*.*.<conv_id>.*`) for replay. Live fan-out to gateways uses core NATS subjects
that are not stored.
"""

from __future__ import annotations

import re

STREAM = "ARENA"
STREAM_SUBJECTS = ("arena.req.>", "arena.res.>", "arena.ctl.>")

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

# Durable pull consumers and what each one reads.
FILTER_CONSUMER = "filter"
FILTER_SUBJECT = f"{REQUESTED}.>"
INFERENCE_CONSUMER = "inference"
INFERENCE_SUBJECT = f"{ACCEPTED}.>"
DELIVERY_CONSUMER = "delivery"
DELIVERY_SUBJECT = "arena.res.>"
CANCEL_SUBJECT = f"{CANCELLED}.>"

LIVE_PREFIX = "arena.live"

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]{1,128}$")


def is_valid_token(value: str) -> bool:
    """Ids become subject tokens, so they may hold no dots, wildcards or spaces."""
    return bool(_TOKEN.match(value))


def subject_for(event) -> str:
    return f"{STEM_BY_TYPE[event.type]}.{event.conv_id}.{event.request_id}"


def request_filter(request_id: str) -> str:
    return f"arena.*.*.*.{request_id}"


def conversation_filter(conv_id: str) -> str:
    return f"arena.*.*.{conv_id}.*"


def live_subject(request_id: str) -> str:
    """Core-NATS subject on which delivery fans a request's output out to gateways."""
    return f"{LIVE_PREFIX}.{request_id}"


def dedupe_key(event) -> str:
    """Nats-Msg-Id for an event: the server drops a second publish of the same fact.

    A request has one terminal event whatever its kind, and one chunk per sequence
    number, so a worker that regenerates a request after a crash cannot duplicate them.
    """
    if event.type in ("chat.completed", "chat.failed", "prompt.rejected"):
        return f"{event.request_id}:terminal"
    if event.type == "tokens.generated":
        return f"{event.request_id}:tok:{event.seq}"
    return f"{event.request_id}:{event.type}"


# Core-NATS subject on which every consumer process announces itself (not stored).
HEARTBEAT_PREFIX = "arena.hb"


def heartbeat_subject(role: str, instance: str) -> str:
    return f"{HEARTBEAT_PREFIX}.{role}.{instance}"


# Core-NATS request subject for hot swap: every inference process answers.
ADMIN_MODELS = "arena.admin.models"
