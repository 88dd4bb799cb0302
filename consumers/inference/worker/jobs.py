"""A job (a pulled request the worker holds until its terminal event is stored) and what
the worker's outbox carries for it, as small typed values."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from consumers.inference.engine_io import GenRequest
from consumers.inference.runners.base import Runner
from events.models import PromptAccepted, Terminal, TokensGenerated


@dataclass
class Job:
    event: PromptAccepted
    msg: Msg  # acked after the terminal event
    runner: Runner
    pin: AsyncExitStack
    started_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    seq: int = 0
    generated: int = 0  # tokens so far
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list = field(default_factory=list)  # the engine's, for the next chunk (when asked)
    text: str = ""
    #: Chunks sent to the stream whose acknowledgement is still to be collected, by seq.
    unconfirmed: dict[int, tuple[TokensGenerated, asyncio.Future | None]] = field(default_factory=dict)
    closed: bool = False  # its terminal event is queued; later engine outputs are ignored
    span: Span | None = None  # its trace's inference span (None: tracing off)
    gen: GenRequest | None = None  # what the engine runs (when it joined a batch)

    @property
    def ids(self) -> dict:
        e = self.event
        return dict(request_id=e.request_id, conv_id=e.conv_id, turn_id=e.turn_id)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk of the job's tokens, to send live and to the stream."""

    job: Job
    event: TokensGenerated


@dataclass(frozen=True, slots=True)
class Ended:
    """The job's terminal event, to store before its message is acked; ``reaped``: the
    watchdog failed it, and its message is terminated instead."""

    job: Job
    terminal: Terminal
    reaped: bool = False


@dataclass(frozen=True, slots=True)
class GiveBack:
    """The job's engine died under it: its chunks stored, its message is given back."""

    job: Job


#: What the outbox carries, in the order the engine made it.
OutboxItem = Chunk | Ended | GiveBack
