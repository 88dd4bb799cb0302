"""Hot swap: add, reload or remove a model while the process serves others.

Requests arrive on a core-NATS subject every inference process listens to, so one
command changes the whole fleet; each process answers with its resident models. The
messages are `events.admin`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from consumers.inference.engine import prepack
from consumers.inference.model_loading import ModelSpec, resolve_source
from events.admin import (
    AddModel,
    ListModels,
    ModelCommand,
    ModelDetails,
    ModelsAnswer,
    ReloadModel,
    RemoveModel,
    decode_command,
)

log = logging.getLogger(__name__)


async def apply(
    pool,
    command: ModelCommand,
    models_dir: str = ".",
    default_model: str | None = None,
    warm: Callable[[list[str]], Awaitable[None]] | None = None,
    loading: set[str] | None = None,
) -> ModelsAnswer:
    """Carry out ``command`` on ``pool``. An added model is loaded with ``warm`` (the
    service's: weights and a started, profiled engine; else the pool's), its name in
    ``loading`` meanwhile (the heartbeat's `loading`: the gateways refuse its requests
    early instead of letting them wait out their deadline behind the load)."""
    match command:
        case ListModels():
            return ModelsAnswer(ok=True, **served(pool), details=tuple(describe(pool, s) for s in pool.specs()))
        case AddModel(spec=source, load=load):
            # A relative path as the models config resolves it; none there and no hub id: said so.
            given = source.model_dump(exclude_none=True)
            if source.backend != "upstream":  # an upstream's path is its URL
                given["path"] = resolve_source(source.path, models_dir)
            spec = ModelSpec(**given)
            await pool.add(spec)
            if load:
                adding = loading if loading is not None else set()
                adding.add(spec.name)
                try:
                    await (warm or pool.warm)([spec.name])
                except BaseException:  # one that cannot load is not served (every request to it would fail)
                    await pool.remove(spec.name)
                    raise
                finally:
                    adding.discard(spec.name)
        case ReloadModel(name=name, spec=source):
            new_spec = ModelSpec(**source.model_dump()) if source is not None else None
            loaded = await pool.reload(name, new_spec)
            log.info("reloaded %s as version %d", loaded.spec.name, loaded.version, extra={"model": loaded.spec.name})
        case RemoveModel(name=name):
            if name == default_model:
                raise ValueError(
                    f"model {default_model!r} is the default model (ARENA_DEFAULT_MODEL): every request that names "
                    "no model goes to it, and /readyz waits for it; start the stack with another default first"
                )
            await pool.remove(name)
    return ModelsAnswer(ok=True, **served(pool))


def describe(pool, spec: ModelSpec) -> ModelDetails:
    """What `arena models list` shows of a model: where it comes from, its context and its
    weights' quantization (None: float);
    resident, what it costs (parameters, dtype, bytes) and whether it has a chat template
    of its own (else its prompts are the messages' contents, FALLBACK_TEMPLATE)."""
    loaded = pool.resident_model(spec.name)
    out = dict(name=spec.name, source=spec.path, base=spec.base, context=pool.contexts().get(spec.name))
    if loaded is None:
        return ModelDetails(**out, quantize=spec.quantize, resident=False)
    model = loaded.model
    if spec.upstream is not None:  # its server has the weights
        parameters, dtype = None, f"{spec.upstream.model} (upstream)"
    elif model is None:  # llama.cpp serves it: its GGUF says what the weights are
        parameters, dtype = loaded.parameters, f"{loaded.weights_type} (llama.cpp)"
    else:
        parameters, dtype = prepack.parameter_count(model), str(model.dtype).removeprefix("torch.")
    return ModelDetails(
        **out,
        quantize=spec.quantize,
        resident=True,
        backend=spec.backend,
        parameters=parameters,
        dtype=dtype,
        chat_template=bool(spec.chat_template or getattr(loaded.tokenizer, "chat_template", None)),
        resident_bytes=loaded.nbytes,
    )


def served(pool) -> dict[str, tuple[str, ...]]:
    """What a process serves after a command, whether it succeeded or not."""
    return {"models": tuple(s.name for s in pool.specs()), "resident": tuple(pool.resident())}


def handler(
    pool,
    instance: str,
    models_dir: str = ".",
    default_model: str | None = None,
    warm: Callable[[list[str]], Awaitable[None]] | None = None,
    loading: set[str] | None = None,
):
    async def on_admin(msg) -> None:
        try:
            reply = await apply(pool, decode_command(msg.data), models_dir, default_model, warm, loading)
        except Exception as exc:  # noqa: BLE001 - every command gets an answer, with the cause
            reply = ModelsAnswer(ok=False, error=f"{type(exc).__name__}: {exc}", **served(pool))
        if msg.reply:
            await msg.respond(reply.model_copy(update={"instance": instance}).encode())

    return on_admin
