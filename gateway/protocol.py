"""OpenAI-compatible request and response models for the chat endpoints."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    WithJsonSchema,
    field_validator,
)

from events.models import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, MAX_TOKENS_LIMIT, MIN_TEMPERATURE


def _encodable(v: str) -> str:
    # JSON may carry lone surrogates ("\\ud800") that no UTF-8 encoder accepts: refuse them
    # here, with the field's name, instead of failing when the event is published.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (a lone surrogate cannot be encoded)") from None
    return v


#: Every client string: valid Unicode, or 400 naming the field.
Text = Annotated[str, AfterValidator(_encodable)]
#: JSON numbers and integers as the schema says: `true` is not 1.
Number = Annotated[float, Strict()]
#: JSON Schema's integers include 1.0; booleans and strings are not integers.
_integral = BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)
#: The largest seed: JSON numbers past 2**53 lose precision in most clients and validators.
MAX_SEED = 2**53 - 1
# Integer fields, with their bounds inside (outside, the schema would lose them).
Tokens = Annotated[int, Strict(), Field(ge=1, le=MAX_TOKENS_LIMIT), _integral]
Seed = Annotated[int, Strict(), Field(ge=0, le=MAX_SEED), _integral]
TurnId = Annotated[int, Strict(), Field(ge=0), _integral]
#: A conversation id, as the schema declares it (the pattern admits no surrogate, so it
#: needs no `Text` check; on top of one, pydantic would leave the pattern out of the schema).
ConvId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]


def _sampleable(v: float) -> float:
    if 0 < v < MIN_TEMPERATURE:
        raise ValueError(
            f"must be 0 (greedy) or at least {MIN_TEMPERATURE}: smaller ones leave the sampler nothing to sample"
        )
    return v


#: The temperature every transport accepts.
Temperature = Annotated[
    float,
    Strict(),
    Field(ge=0.0, le=2.0),
    AfterValidator(_sampleable),
    WithJsonSchema(
        {
            "anyOf": [{"type": "number", "enum": [0]}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": 2.0}],
            "description": f"0 (greedy) or from {MIN_TEMPERATURE} to 2.",
        }
    ),
]
#: A time budget in seconds (strict: `true` is not a number).
Deadline = Annotated[float, Strict(), Field(gt=0, description="Time budget in seconds; default 15, at most 120.")]
StopText = Annotated[Text, Field(min_length=1)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


#: OpenAI request fields that are refused unless neutral: field -> its neutral values
#: (null first, then the one a client sends to mean "none").
UNSERVED: dict[str, tuple] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Strict()] = False


class ChatCompletionRequest(BaseModel):
    """The OpenAI chat completion request, plus arenaflow's conversation fields."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = Field(None, description="Served model name; default: the gateway's default model.")
    messages: list[Message] = Field(min_length=1, description="Empty contents are accepted (OpenAI does too).")
    temperature: Temperature = DEFAULT_TEMPERATURE
    top_p: Number = Field(DEFAULT_TOP_P, gt=0.0, le=1.0)
    max_tokens: Tokens | None = Field(None, description=f"Default {DEFAULT_MAX_TOKENS}.")
    max_completion_tokens: Tokens | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    seed: Seed | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=1), _integral] = Field(1, description="Only one choice is served.")
    stream: Annotated[bool, Strict()] = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    conv_id: ConvId | None = Field(None, description="Conversation id (letters, digits, '_' and '-').")
    turn_id: TurnId | None = Field(None, description="Turn index inside the conversation.")
    deadline_s: Deadline | None = None
    # OpenAI fields this server does not serve: refused with a 400 naming the field when
    # they ask for anything (their neutral values pass), never accepted and ignored.
    logprobs: Any = Field(None, description="Not served: only false/null is accepted.")
    top_logprobs: Any = Field(None, description="Not served: only 0/null is accepted.")
    presence_penalty: Any = Field(None, description="Not served: only 0/null is accepted.")
    frequency_penalty: Any = Field(None, description="Not served: only 0/null is accepted.")
    logit_bias: Any = Field(None, description="Not served: only {}/null is accepted.")
    response_format: Any = Field(None, description='Not served: only {"type": "text"} is accepted.')
    tools: Any = Field(None, description="No tool calling: only []/null is accepted.")
    tool_choice: Any = Field(None, description='No tool calling: only "none"/null is accepted.')
    functions: Any = Field(None, description="No function calling: only []/null is accepted.")
    function_call: Any = Field(None, description='No function calling: only "none"/null is accepted.')

    @field_validator(*UNSERVED)
    @classmethod
    def _unserved(cls, v, info):
        if v not in UNSERVED[info.field_name]:
            raise ValueError(f"is not supported by this server (accepted: {UNSERVED[info.field_name][1]!r} or null)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return [v] if isinstance(v, str) else (v or [])

    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


def completion_body(
    request_id: str, model: str, text: str, finish_reason: str, usage: dict, extra: dict | None = None
) -> dict:
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage,
        **({"x_arena": extra} if extra else {}),
    }


def chunk_body(
    request_id: str,
    model: str,
    delta: dict,
    finish_reason: str | None = None,
    usage: dict | None = None,
    with_choice: bool = True,
) -> dict:
    body = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
        if with_choice
        else [],
    }
    if usage is not None:
        body["usage"] = usage
    return body
