"""Hot swap: add, reload or remove a model while the process serves others.

Requests arrive on a core-NATS subject every inference process listens to, so one
command changes the whole fleet; each process answers with its resident models.
"""

from __future__ import annotations

import json
import logging

from consumers.inference.models import ModelSpec, resolve_source

log = logging.getLogger(__name__)


async def apply(pool, command: dict, models_dir: str = ".", default_model: str | None = None) -> dict:
    op = command.get("op")
    if op == "list":
        return {"ok": True, **served(pool), "details": [describe(pool, spec) for spec in pool.specs()]}
    elif op == "add":
        # A relative path as the models config resolves it; none there and no hub id: said so.
        spec = ModelSpec(**{**command["spec"], "path": resolve_source(command["spec"]["path"], models_dir)})
        await pool.add(spec)
        if command.get("load", True):
            try:
                await pool.warm([spec.name])
            except BaseException:  # one that cannot load is not served (every request to it would fail)
                await pool.remove(spec.name)
                raise
    elif op == "reload":
        new_spec = ModelSpec(**command["spec"]) if command.get("spec") else None
        loaded = await pool.reload(command["name"], new_spec)
        log.info("reloaded %s as version %d", loaded.spec.name, loaded.version, extra={"model": loaded.spec.name})
    elif op == "remove":
        if command["name"] == default_model:
            raise ValueError(
                f"model {default_model!r} is the default model (ARENA_DEFAULT_MODEL): every request that names "
                "no model goes to it, and /readyz waits for it; start the stack with another default first"
            )
        await pool.remove(command["name"])
    else:
        raise ValueError(f"op must be list, add, reload or remove; got {op!r}")
    return {"ok": True, **served(pool)}


def describe(pool, spec: ModelSpec) -> dict:
    """What `arena models list` shows of a model: where it comes from, its context and its
    weights' quantization (None: float);
    resident, what it costs (parameters, dtype, bytes) and whether it has a chat template
    of its own (else its prompts are the messages' contents, FALLBACK_TEMPLATE)."""
    loaded = pool.resident_model(spec.name)
    out: dict = {
        "name": spec.name,
        "source": spec.path,
        "base": spec.base,
        "context": pool.contexts().get(spec.name),
        "quantize": spec.quantize,
    }
    if loaded is None:
        return {**out, "resident": False}
    model = loaded.model
    return {
        **out,
        "resident": True,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype).removeprefix("torch."),
        "chat_template": bool(spec.chat_template or getattr(loaded.tokenizer, "chat_template", None)),
        "resident_bytes": loaded.nbytes,
    }


def served(pool) -> dict:
    """What a process serves after a command, whether it succeeded or not."""
    return {"models": [s.name for s in pool.specs()], "resident": pool.resident()}


def handler(pool, instance: str, models_dir: str = ".", default_model: str | None = None):
    async def on_admin(msg) -> None:
        try:
            reply = await apply(pool, json.loads(msg.data), models_dir, default_model)
        except Exception as exc:  # noqa: BLE001 - every command gets an answer, with the cause
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", **served(pool)}
        reply["instance"] = instance
        if msg.reply:
            await msg.respond(json.dumps(reply).encode())

    return on_admin
