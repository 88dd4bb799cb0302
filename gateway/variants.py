"""Model variants' request defaults, as the inference processes announce them.

A variant (`base:` in the models config) serves its base's weights under its own name
with its own sampling defaults and system prompt. The gateway applies them to the
request before it becomes a `ChatRequested` event, so the event records the parameters
the model really ran with (and replay shows them); a field the client set wins.
"""

from __future__ import annotations

from typing import Any

from events.fleet import InferenceBeat, ProcessBeat, VariantDefaults
from gateway.protocol import ChatCompletionRequest, Message

SAMPLING = ("temperature", "top_p", "max_tokens")


def model_defaults(beats: list[ProcessBeat]) -> dict[str, VariantDefaults]:
    """Defaults per model name, as the live inference heartbeats announce them."""
    return {name: d for b in beats if isinstance(b, InferenceBeat) for name, d in b.defaults.items()}


def model_owners(beats: list[ProcessBeat]) -> dict[str, str]:
    """Owner per model name (the heartbeats' `owners` field; the models config's `owner:`)."""
    return {name: o for b in beats if isinstance(b, InferenceBeat) for name, o in b.owners.items()}


def with_model_defaults(req: ChatCompletionRequest, defaults: VariantDefaults | None) -> ChatCompletionRequest:
    """`req` with the model's defaults for the fields it did not set (pure)."""
    if defaults is None:
        return req
    given = req.model_fields_set
    update: dict[str, Any] = {
        k: getattr(defaults, k)
        for k in SAMPLING
        if getattr(defaults, k) is not None
        and k not in given
        and not (k == "max_tokens" and "max_completion_tokens" in given)
    }
    # A completion's prompt goes to the model as it is: no system message has a place in it.
    if (
        defaults.system
        and req.prompt_format == "chat"
        and not any(m.role in ("system", "developer") for m in req.messages)
    ):
        update["messages"] = [Message(role="system", content=defaults.system), *req.messages]
    if not update:
        return req
    new = req.model_copy(update=update)
    # model_copy keeps the original fields_set; the defaults count as given from here on.
    new.__pydantic_fields_set__ = given | set(update)
    return new
