"""The event contract: one frozen pydantic model per event, past tense.

Every event carries its id, when it happened and its schema version; request events
(`RequestEvent`) also the request, conversation and turn they belong to, battle events
(`BattleEvent`) the battle. Events are immutable facts: a
breaking change gets a new schema version and an upcaster (see `events.codec`).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema


def new_id() -> str:
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(UTC)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Additive(Frozen):
    """A model that gained optional fields after events were stored (`ADDITIVE`, each
    with a default): `events.encode` leaves them out while at their defaults, so an event
    that uses none of them is written as before, and a process still on the earlier
    contract (extra="forbid") decodes it during a rolling deploy. Decoding fills them in."""

    ADDITIVE: ClassVar[tuple[str, ...]] = ()


def unused_additions(model: BaseModel) -> dict[str, Any]:
    """What `model_dump_json(exclude=...)` leaves out of `model`: its additive fields at
    their defaults, and those of the additive models its fields hold (one level down, as
    ChatRequested holds SamplingParams). A few attribute reads: it runs on every chunk."""
    defaults, nested = _additions(type(model))
    out: dict[str, Any] = {name: True for name, default in defaults if getattr(model, name) == default}
    for name in nested:
        inner_defaults, _ = _additions(type(value := getattr(model, name)))
        if inner := {n: True for n, default in inner_defaults if getattr(value, n) == default}:
            out[name] = inner
    return out


_ADDITIONS: dict[type, tuple[tuple[tuple[str, Any], ...], tuple[str, ...]]] = {}


def _additions(cls: type[BaseModel]) -> tuple[tuple[tuple[str, Any], ...], tuple[str, ...]]:
    """`cls`'s additive fields with their defaults, and its fields holding additive models."""
    if (found := _ADDITIONS.get(cls)) is None:
        fields = cls.model_fields
        additive = getattr(cls, "ADDITIVE", ())
        defaults = tuple((n, fields[n].get_default(call_default_factory=True)) for n in additive)
        nested = tuple(
            n for n, f in fields.items() if isinstance(f.annotation, type) and issubclass(f.annotation, Additive)
        )
        found = _ADDITIONS[cls] = (defaults, nested)
    return found


class ChatMessage(Frozen):
    role: Literal["system", "user", "assistant"]
    content: str


#: The sampling defaults, once for every transport and the engine (OpenAI's temperature).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MAX_TOKENS = 64
MAX_TOKENS_LIMIT = 4096
#: A temperature is 0 (greedy) or at least this: smaller ones underflow in float32 and
#: leave the sampler nothing to sample. Checked at the edge and by the worker, not in
#: the event (events already stored must still decode).
MIN_TEMPERATURE = 0.01
#: The most alternatives a token's log probabilities list (OpenAI's top_logprobs bound).
MAX_TOP_LOGPROBS = 20
#: OpenAI's bound on a token's logit_bias.
MAX_BIAS = 100.0


def _bias_pairs(v: Any) -> Any:
    # JSON writes logit_bias as an object; held as pairs, sorted, so params stay immutable
    return list(v.items()) if isinstance(v, Mapping) else v


#: Token id -> added to its logit: a JSON object on the wire, sorted (id, bias) pairs in memory.
LogitBias = Annotated[
    tuple[tuple[int, float], ...],
    BeforeValidator(_bias_pairs),
    AfterValidator(lambda pairs: tuple(sorted(pairs))),
    PlainSerializer(dict, return_type=dict[int, float]),
    WithJsonSchema({"additionalProperties": {"type": "number"}, "type": "object"}),
]


class SamplingParams(Additive):
    """Per-request sampling parameters; they hold inside any batch. The gateway writes them
    into ChatRequested and the engine samples by them as they are.

    Decoding checks the ranges every stored event keeps; `checked()` what the engine
    cannot serve beyond that (events already stored must still decode)."""

    ADDITIVE = ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "ignore_eos")

    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0.0, le=2.0, description="0 means greedy decoding.")
    top_p: float = Field(DEFAULT_TOP_P, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, le=MAX_TOKENS_LIMIT, description="Most tokens to generate.")
    stop: tuple[str, ...] = Field((), description="Strings that end generation; not included in the text.")
    seed: int | None = Field(None, description="Seed of the request's own RNG; set by the gateway when absent.")
    # Optional and additive (OpenAI's penalties, bias and log probabilities): events written
    # before them decode unchanged, as requests that ask for none of them.
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of every token generated at least once so far."
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit once per time it was generated so far."
    )
    logit_bias: LogitBias = Field(
        default_factory=tuple, description="Token id -> added to its logit (-100 bans it, 100 all but forces it)."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="None: no log probabilities; n: each token's, with its n most likely alternatives.",
    )
    ignore_eos: bool = Field(
        False, description="Generation goes on past the end-of-sequence token, to max_tokens or a stop string."
    )

    @property
    def greedy(self) -> bool:
        """Argmax decoding: top_p and seed are then unused."""
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """True when its logits change before selection (penalties or bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    def checked(self) -> SamplingParams:
        """These params, or ValueError naming what the engine cannot serve."""
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {self.temperature}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(t < 0 or not -MAX_BIAS <= b <= MAX_BIAS for t, b in self.logit_bias):
            raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-{MAX_BIAS}, {MAX_BIAS}]")
        return self


class Usage(Frozen):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(Frozen):
    """Seconds spent in each phase, measured by the inference worker."""

    queue_wait_s: float = Field(description="From the gateway's receipt to the start of compute.")
    ttft_s: float = Field(description="From the gateway's receipt to the first token.")
    decode_s: float = Field(description="From the first token to the last.")
    compute_s: float = Field(description="From the start of compute to the last token.")


class ClassifierFeature(Frozen):
    """One n-gram behind a classifier verdict."""

    text: str = Field(description="The n-gram as the classifier read it (folded, lower case).")
    weight: float = Field(description="Its contribution to the logit; positive pushes towards attack.")


class ClassifierReport(Frozen):
    """The trained classifier stage's verdict on the highest-scoring user message."""

    version: str = Field(description="The classifier artifact that scored the prompt.")
    score: float = Field(description="Attack probability in [0, 1].")
    threshold: float = Field(description="Score at or above which the prompt is flagged.")
    flagged: bool = Field(description="score >= threshold.")
    enforced: bool = Field(description="The flag rejected the prompt (mode block); false in shadow/sanitize-only.")
    features: tuple[ClassifierFeature, ...] = Field((), description="Top n-grams behind a flag (empty when clear).")
    # Optional and additive (ensemble stages): events written before them decode unchanged.
    stage: str | None = Field(None, description="The ensemble stage (chars, words...); None: a lone classifier.")
    mode: Literal["block", "shadow"] | None = Field(
        None, description="The stage's mode: block (its flag rejects) or shadow (recorded and counted only)."
    )
    benign_tail: float | None = Field(
        None, description="Share of held-out benign prompts scoring at least this (the stage's calibration)."
    )


class FilterReport(Frozen):
    """What the prompt filter did, kept in the event for audits."""

    action: Literal["pass", "sanitized", "reject"]
    score: float = 0.0
    reasons: tuple[str, ...] = ()
    edits: tuple[str, ...] = ()
    # Optional and additive: events written before the classifier stage decode unchanged.
    classifier: ClassifierReport | None = Field(None, description="The classifier stage; None when it did not run.")
    stages: tuple[ClassifierReport, ...] = Field(
        (), description="Every stage of a classifier ensemble on the deciding user message (empty: one classifier)."
    )


class EventBase(Frozen):
    """What every event has, whatever it is about. Subclasses set `type` (a Literal)."""

    type: str = Field(description="The event's kind, e.g. 'chat.requested'; selects its model when decoding.")
    event_id: str = Field(default_factory=new_id, description="Unique id of this event.")
    occurred_at: datetime = Field(default_factory=utcnow)
    schema_version: int = 1

    #: True for the event that ends its subject's life (one per request).
    terminal: ClassVar[bool] = False

    @classmethod
    def type_name(cls) -> str:
        return str(cls.model_fields["type"].default)

    def dedupe_key(self) -> str:
        """Nats-Msg-Id: the server drops a second publish of the same fact."""
        raise NotImplementedError


class RequestEvent(EventBase):
    """An event in the life of one chat request."""

    request_id: str = Field(description="The request this event belongs to.")
    conv_id: str = Field(description="The conversation; equals request_id for one-shot requests.")
    turn_id: int = Field(0, ge=0, description="Index of the turn inside the conversation.")

    def dedupe_key(self) -> str:
        # A request has one terminal event whatever its kind, so a worker that
        # regenerates a request after a crash cannot publish a second one.
        return f"{self.request_id}:terminal" if self.terminal else f"{self.request_id}:{self.type_name()}"


class BattleEvent(EventBase):
    """An event in the life of one arena battle: no chat request stands behind it."""

    battle_id: str = Field(description="The battle this event belongs to.")

    def dedupe_key(self) -> str:
        return f"battle:{self.battle_id}:{self.type_name()}"


#: How a request's messages become the model's prompt.
PromptFormat = Literal["chat", "text"]
PROMPT_FORMAT = (
    "chat: the messages rendered with the model's chat template; text: the one user message's "
    "content is the prompt as it is (POST /v1/completions). Optional and additive."
)


class StatusChange(EventBase):
    """A change of status that may happen again and again (a vote's, a model's): `revision`
    counts the changes before it, so each is a fact of its own, while a retry of one is
    still deduplicated."""

    reason: str = Field(description="Why: a check's finding, or the operator's words.")
    revision: int = Field(0, ge=0, description="How many status changes its subject had before this one.")

    def dedupe_key(self) -> str:
        return f"{super().dedupe_key()}:{self.revision}"


class ModelEvent(EventBase):
    """An event about one arena model as a whole (not one battle of it)."""

    model: str = Field(description="The model's served name.")

    def dedupe_key(self) -> str:
        return f"model:{self.model}:{self.type_name()}"


class ChatSpec(Frozen):
    """What to answer, as the client asked it: the model, the conversation, how to sample
    and until when. ChatRequested states it; PromptAccepted carries it on to inference
    as it is, with the filter's messages (perhaps sanitized) in place of the client's."""

    model: str
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    deadline_at: float = Field(description="Epoch seconds after which the answer is useless.")
    received_at: float = Field(default_factory=time.time, description="Epoch seconds of the gateway's receipt.")
    prompt_format: PromptFormat = Field("chat", description=PROMPT_FORMAT)

    def spec(self) -> dict[str, Any]:
        """Its ChatSpec fields, by name: what another event of the request carries on."""
        return {name: getattr(self, name) for name in ChatSpec.model_fields}


class ChatRequested(ChatSpec, RequestEvent, Additive):
    """The gateway accepted a client request."""

    ADDITIVE = ("prompt_format",)

    type: Literal["chat.requested"] = "chat.requested"
    stream: bool = False
    idempotency_key: str | None = None
    principal: str | None = Field(
        None, description="Who asked: a keyed hash of the caller's API key (never the key); restores ownership."
    )


class PromptAccepted(ChatSpec, RequestEvent, Additive):
    """The filter let the prompt through (possibly sanitized)."""

    ADDITIVE = ("prompt_format",)

    type: Literal["prompt.accepted"] = "prompt.accepted"
    filter: FilterReport

    @classmethod
    def of(cls, requested: ChatRequested, messages: tuple[ChatMessage, ...], report: FilterReport) -> PromptAccepted:
        """`requested` let through: its spec as it is, with `messages` in place of its own."""
        ids = dict(request_id=requested.request_id, conv_id=requested.conv_id, turn_id=requested.turn_id)
        return cls(**ids, **(requested.spec() | {"messages": messages}), filter=report)


class PromptRejected(RequestEvent):
    """The filter refused the prompt; no model time is spent on it. Terminal."""

    type: Literal["prompt.rejected"] = "prompt.rejected"
    terminal: ClassVar[bool] = True
    reason: str
    filter: FilterReport


class TopLogprob(Frozen):
    """A token and its log probability, as OpenAI's API shows one."""

    token: str = Field(description="The token's text (its bytes decoded, U+FFFD where they end inside a character).")
    logprob: float = Field(description="Natural log of its probability under the model's raw logits.")
    bytes: tuple[int, ...] = Field(description="The token's UTF-8 bytes (tokens may split a character).")


class TokenLogprob(TopLogprob):
    """A generated token's log probability, and its most likely alternatives at that step."""

    top_logprobs: tuple[TopLogprob, ...] = Field((), description="The n most likely tokens, most likely first.")


class TokensGenerated(RequestEvent, Additive):
    """A chunk of generated text. `seq` counts chunks of one request from 0, without gaps."""

    ADDITIVE = ("logprobs",)

    type: Literal["tokens.generated"] = "tokens.generated"
    seq: int = Field(ge=0)
    text: str
    token_ids: tuple[int, ...]
    model: str
    # Optional and additive: events written before it decode unchanged.
    logprobs: tuple[TokenLogprob, ...] | None = Field(
        None,
        description="With params.logprobs: one per token id, in order, less an end-of-sequence token "
        "(it ends the answer and is no part of its text); None when not asked for.",
    )

    def dedupe_key(self) -> str:
        return f"{self.request_id}:tok:{self.seq}"


class ChatCompleted(RequestEvent):
    """The model finished the answer. Terminal."""

    type: Literal["chat.completed"] = "chat.completed"
    terminal: ClassVar[bool] = True
    model: str
    text: str
    finish_reason: Literal["stop", "length"]
    usage: Usage
    timings: Timings
    chunks: int = Field(description="How many TokensGenerated chunks precede this event.")


FailureCode = Literal[
    "deadline_exceeded",
    "unknown_model",
    "prompt_too_long",
    "cancelled",
    "overloaded",
    "internal_error",
    "invalid_request",  # a parameter the model cannot serve (a logit_bias token outside its vocabulary)
    "deadline_too_short",  # more tokens than the model makes within the request's deadline even alone
    "model_unavailable",  # its upstream server is down (the circuit is open): retry later
]


class ChatFailed(RequestEvent):
    """The request ended without an answer. Terminal."""

    type: Literal["chat.failed"] = "chat.failed"
    terminal: ClassVar[bool] = True
    code: FailureCode
    message: str
    chunks: int = 0
    #: An `overloaded` worker's guess of when it would have room (whole seconds): the
    #: client's Retry-After. None: 1 s (events written before it had one).
    retry_after_s: int | None = None


class ChatCancelled(RequestEvent):
    """The client went away; inference stops generating the request."""

    type: Literal["chat.cancelled"] = "chat.cancelled"
    reason: str = "client_disconnected"


#: Every event type the codec decodes, by its `type`. Battle events join this table.
EVENT_TYPES: dict[str, type[EventBase]] = {
    cls.type_name(): cls
    for cls in (
        ChatRequested,
        PromptAccepted,
        PromptRejected,
        TokensGenerated,
        ChatCompleted,
        ChatFailed,
        ChatCancelled,
    )
}

#: The event that ends a request, one per request whatever its outcome: test with
#: `isinstance(e, Terminal)` or `match`, so mypy knows which fields it has.
Terminal = PromptRejected | ChatCompleted | ChatFailed
#: A request's end without an answer.
Failure = PromptRejected | ChatFailed
#: A request's output, as delivery fans it out and the gateway follows it.
Output = TokensGenerated | Terminal

TERMINAL_TYPES = frozenset(cls.type_name() for cls in get_args(Terminal))
FAILURE_TYPES = frozenset(cls.type_name() for cls in get_args(Failure))
