"""Hot swap's messages: the operator's command to every inference process, and each one's answer.

`arena models add|reload|remove|list` publishes a `ModelCommand` on core NATS
(`subjects.ADMIN_MODELS`, a request with a reply inbox); every inference process applies
it and answers with a `ModelsAnswer`. Neither is stored. The JSON keys are those the
dicts had before these models; answers are written with `exclude_unset`, so a field a
process did not set (an unloaded model's size, a success's error) is left out as before.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

ADMIN_VERSION = 1


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSource(_Message):
    """Where a model's weights are and how to place them (a models config entry's first
    fields; `consumers.inference.model_loading.ModelSpec` validates them when applied)."""

    name: str = Field(description="Served model name.")
    path: str = Field(
        "",
        description="Model directory, .gguf file, 'pkg:...' or hub id (relative: the models directory's); "
        "none for backend upstream.",
    )
    dtype: str = Field("auto", description="float32, bfloat16, float16 or auto.")
    device: str = Field("cpu", description="torch device: 'cpu', 'cuda' or 'cuda:N'.")
    quantize: str | None = Field(None, description="int8 or int4 weight-only quantization; None: float weights.")
    backend: str = Field(
        "builtin", description="What computes its tokens: 'builtin', 'llamacpp' (a GGUF) or 'upstream' (a server)."
    )
    upstream: dict[str, bool | str | int | float | list[str]] | None = Field(
        None,
        description="backend upstream: the models config's upstream: block (base_url, model, api_key_env or "
        "api_key_file: the name of where the key is, never the key).",
    )


class _Command(_Message):
    schema_version: int = ADMIN_VERSION


class ListModels(_Command):
    """Answer with every model served and what each is and costs."""

    op: Literal["list"] = "list"


class AddModel(_Command):
    """Serve a new model (and load it, unless `load` is false)."""

    op: Literal["add"] = "add"
    name: str
    spec: ModelSource
    load: bool = Field(True, description="Load it now; one that cannot load is not served.")


class ReloadModel(_Command):
    """Load a served model again: from its weights as they are now, or from new ones (`spec`)."""

    op: Literal["reload"] = "reload"
    name: str
    spec: ModelSource | None = None


class RemoveModel(_Command):
    """Stop serving a model (never the default model)."""

    op: Literal["remove"] = "remove"
    name: str


ModelCommand = Annotated[ListModels | AddModel | ReloadModel | RemoveModel, Field(discriminator="op")]
_COMMANDS: TypeAdapter[ModelCommand] = TypeAdapter(ModelCommand)


def decode_command(raw: bytes | str) -> ListModels | AddModel | ReloadModel | RemoveModel:
    """The command in `raw`; pydantic's ValidationError (a ValueError) naming what is wrong."""
    return _COMMANDS.validate_json(raw)


class ModelDetails(_Message):
    """What `arena models list` shows of one model; the last five only while it is loaded."""

    name: str
    source: str = Field(description="Where its weights come from (the config's `path`).")
    base: str | None = Field(description="The model a variant serves the weights of.")
    context: int | None = Field(description="Tokens a request may have, prompt and completion; None: not known yet.")
    quantize: str | None = Field(description="int8 / int4 weight-only quantization; None: float weights.")
    resident: bool
    backend: str | None = Field(None, description="What computes its tokens ('builtin', 'llamacpp'), while loaded.")
    parameters: int | None = None
    dtype: str | None = None
    chat_template: bool | None = Field(None, description="It has a chat template of its own (else plain text).")
    resident_bytes: int | None = None


class ModelsAnswer(_Message):
    """One inference process's answer to a command: what it serves after it, whether or not it succeeded."""

    ok: bool
    instance: str = Field("", description="The answering process's instance id.")
    models: tuple[str, ...] = Field((), description="Every model it serves.")
    resident: tuple[str, ...] = Field((), description="The models loaded now.")
    error: str | None = Field(None, description="Why the command failed (its exception), when it did.")
    details: tuple[ModelDetails, ...] = Field((), description="For `list`: each model's details.")

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_unset=True).encode()
