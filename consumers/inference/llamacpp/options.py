"""How a `backend: llamacpp` model's `llama-server` runs: the models config's `llamacpp:` block."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: Tokens per slot when the config says none: a chat turn with its history fits, and the
#: KV cache llama.cpp allocates up front (slots x this x bytes per token) stays small.
DEFAULT_SLOT_CONTEXT = 2048


class LlamaCppOptions(BaseModel):
    """A `backend: llamacpp` model's server: its slots, their context and its threads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    parallel: int | None = Field(
        None,
        ge=1,
        le=512,
        description="Slots (`--parallel`): requests decoded together, continuous batching. "
        "Unset: the worker's ARENA_MAX_BATCH_SIZE.",
    )
    context: int | None = Field(
        None,
        ge=16,
        description="Tokens (prompt and completion) per slot; `--ctx-size` is parallel x this, allocated when "
        f"the server starts. Unset: the model's context, at most {DEFAULT_SLOT_CONTEXT}.",
    )
    threads: int | None = Field(
        None, ge=1, description="`--threads`: unset, ARENA_LLAMA_CPP_THREADS, else every core this worker may use."
    )
    args: tuple[str, ...] = Field((), description="More llama-server flags, as on its command line.")
