"""Hot swap: add, reload or remove a model while the process serves others.

Requests arrive on a core-NATS subject every inference process listens to, so one
command changes the whole fleet; each process answers with its resident models.
"""

from __future__ import annotations

import json
import logging

from consumers.inference.errors import InferenceError
from consumers.inference.models import ModelSpec

log = logging.getLogger(__name__)


async def apply(pool, command: dict) -> dict:
    op = command.get("op")
    if op == "list":
        pass
    elif op == "add":
        spec = ModelSpec(**command["spec"])
        await pool.add(spec)
        if command.get("load", True):
            await pool.warm([spec.name])
    elif op == "reload":
        new_spec = ModelSpec(**command["spec"]) if command.get("spec") else None
        loaded = await pool.reload(command["name"], new_spec)
        log.info("reloaded %s as version %d", loaded.spec.name, loaded.version, extra={"model": loaded.spec.name})
    elif op == "remove":
        await pool.remove(command["name"])
    else:
        raise ValueError(f"op must be list, add, reload or remove; got {op!r}")
    return {"ok": True, "models": [s.name for s in pool.specs()], "resident": pool.resident()}


def handler(pool, instance: str):
    async def on_admin(msg) -> None:
        try:
            reply = await apply(pool, json.loads(msg.data))
        except (InferenceError, ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply["instance"] = instance
        if msg.reply:
            await msg.respond(json.dumps(reply).encode())

    return on_admin
