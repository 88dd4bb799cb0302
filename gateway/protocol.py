"""OpenAI-compatible request and response models for the chat endpoints."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from events.models import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, MAX_TOKENS_LIMIT, MIN_TEMPERATURE


def _sampleable(v: float) -> float:
    if 0 < v < MIN_TEMPERATURE:
        raise ValueError(
            f"must be 0 (greedy) or at least {MIN_TEMPERATURE}: smaller ones leave the sampler nothing to sample"
        )
    return v


#: The temperature every transport accepts.
Temperature = Annotated[float, Field(ge=0.0, le=2.0), AfterValidator(_sampleable)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The OpenAI chat completion request, plus arenaflow's conversation fields."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name; default: the gateway's default model.")
    messages: list[Message] = Field(min_length=1)
    temperature: Temperature = DEFAULT_TEMPERATURE
    top_p: float = Field(DEFAULT_TOP_P, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT, description=f"Default {DEFAULT_MAX_TOKENS}.")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is served.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    conv_id: str | None = Field(None, description="Conversation id (letters, digits, '_' and '-').")
    turn_id: int | None = Field(None, ge=0, description="Turn index inside the conversation.")
    deadline_s: float | None = Field(None, gt=0, description="Time budget; default 15 s.")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

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
