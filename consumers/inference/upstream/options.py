"""A `backend: upstream` model's server: the models config's `upstream:` block."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from consumers.inference.errors import PermanentError

#: The request fields an entry may declare its upstream does not take (`unsupported:`).
Feature = Literal[
    "seed", "stop", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"
]
#: The tokens (prompt and completion) of an upstream model when the entry names none.
DEFAULT_CONTEXT = 4096


class UpstreamOptions(BaseModel):
    """An OpenAI-compatible server that computes a model's tokens (vLLM, SGLang, TGI,
    llama-server, Ollama, a hosted API): where it is, how to reach it, what it takes.
    The API key is read from an environment variable or a file, never written here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str = Field(
        description="The server's OpenAI API root, e.g. 'http://gpu-1:8000/v1' (the paths /chat/completions and "
        "/completions are appended)."
    )
    model: str = Field(description="The upstream's model id, as its /v1/models lists it.")
    api_key_env: str | None = Field(
        None, description="An environment variable of the inference worker holding the API key (sent as Bearer)."
    )
    api_key_file: str | None = Field(
        None, description="A file holding the API key (a mounted Kubernetes Secret), read when the model loads."
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="More HTTP headers on every request (not secret: a key goes in api_key_*)."
    )
    concurrency: int = Field(8, ge=1, le=4096, description="Requests streamed to the upstream at once, at most.")
    connect_timeout_s: float = Field(10.0, gt=0, description="The longest wait for a connection to the upstream.")
    read_timeout_s: float = Field(
        60.0, gt=0, description="The longest silence of the upstream before its first token or between two tokens."
    )
    endpoints: tuple[Literal["chat", "completions"], ...] = Field(
        ("chat", "completions"),
        min_length=1,
        description="What the upstream serves: 'chat' (/chat/completions, messages) and 'completions' "
        "(/completions, a text prompt); a request for one it lacks is a 400.",
    )
    unsupported: tuple[Feature, ...] = Field(
        (), description="Request fields the upstream does not take: a request that sets one is a 400 naming it."
    )
    context: int = Field(
        DEFAULT_CONTEXT, ge=16, description="Tokens (prompt and completion) the upstream's model takes."
    )
    profile: bool = Field(
        True,
        description="Time the upstream's steps as the model loads, as the local backends' start-up profile does: "
        "one short greedy request alone, then `concurrency` together (17 tokens each), so that admission judges "
        "its first bursts by the upstream's own figures rather than by the few small batches served first. "
        "false for a server billed per token or one that must see only real traffic: its figures then come from "
        "real requests alone.",
    )
    continue_chat: bool = Field(
        False,
        description="The upstream continues a chat's final assistant message (llama-server; vLLM and SGLang with "
        "continue_final_message): a chat answer broken off mid-stream, or whose worker died, is continued from "
        "its text, sent as that message. Otherwise such an answer ends with a clear error.",
    )

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {v!r}")
        return v.rstrip("/")

    @field_validator("headers")
    @classmethod
    def _no_authorization(cls, v: dict[str, str]) -> dict[str, str]:
        if any(k.lower() == "authorization" for k in v):
            raise ValueError("the key goes in api_key_env or api_key_file, not in headers: Authorization")
        return v

    @model_validator(mode="after")
    def _one_key_source(self) -> UpstreamOptions:
        if self.api_key_env and self.api_key_file:
            raise ValueError("api_key_env or api_key_file, not both")
        return self

    def api_key(self) -> str | None:
        """The key, read now (None: the upstream takes none); PermanentError naming the
        variable or file (never the key) when it cannot be read."""
        if self.api_key_env:
            key = os.environ.get(self.api_key_env, "").strip()
            if not key:
                raise PermanentError(
                    f"api_key_env: {self.api_key_env} is not set in the inference worker's environment"
                )
            return key
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).expanduser().read_text().strip()
            except OSError as exc:
                raise PermanentError(f"api_key_file: cannot read {self.api_key_file}: {exc.strerror}") from None
            if not key:
                raise PermanentError(f"api_key_file: {self.api_key_file} is empty")
            return key
        return None
