"""What the published OpenAPI document says beyond FastAPI's: the limits this deployment and
the models it serves now put on a request, and the arena board's query, so that a request
the document allows is one the checks accept and the other way round (schemathesis'
positive and negative data checks, tests/e2e/test_edge_api.py).

- Token budgets (`max_tokens`, `max_completion_tokens`) stay under the context of the model
  a request names (the default model's when it names none), as served now: past it a
  request is refused (gateway/serving.py). An arena turn, whose models it does not name,
  stays under the smallest.
- A deadline is at least `admission_overhead_s`: a shorter one can never be met, whatever the
  model (gateway/admission/estimate.py). Whether a budget's tokens fit its deadline depends on
  the model's measured speed: that 400, naming the field, stays the model's limit.
- The leaderboard's `style_control` and `category` do not go together (there is no
  style-controlled board per category yet): one query object that says so.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")

#: The leaderboard's query as one form-exploded object (the same query string: ?style_control=true,
#: ?category=coding, ?format=csv), so that the document can say which keys go together.
BOARD = "/arena/leaderboard"


def served_contexts(pipeline) -> dict[str, int]:
    """Each model served now whose context a worker reported (a model not loaded anywhere yet
    has none, and no limit in the document)."""
    return {m: c for m in pipeline.fleet().models if (c := pipeline.context_len(m)) is not None}


def with_served_limits(doc: dict, overhead_s: float, contexts: Mapping[str, int], default_model: str) -> dict:
    """A copy of ``doc`` with the token budgets under the served models' ``contexts`` and
    deadlines of at least ``overhead_s``. A request naming its model (or none: the default
    one) gets that model's limit; a request of an arena battle, whose models it does not
    name, the smallest."""
    doc = copy.deepcopy(doc)
    for schema in doc.get("components", {}).get("schemas", {}).values():
        props = schema.get("properties", {})
        tokens = [n for n in TOKEN_FIELDS if n in props]
        if tokens and contexts:
            named = "model" in props
            bound = (max if named else min)(contexts.values()) - 1
            for name in tokens:
                for branch in _branches(props[name]):
                    if branch.get("type") == "integer":
                        branch["maximum"] = min(branch.get("maximum", bound), bound)
            tighter = [(m, c - 1) for m, c in sorted(contexts.items()) if c - 1 < bound] if named else []
            if tighter:
                schema.setdefault("allOf", []).extend(
                    _model_limit(m, limit, tokens, m == default_model) for m, limit in tighter
                )
        for branch in _branches(props.get("deadline_s", {})):
            if branch.get("type") == "number" and overhead_s > 0:
                branch.pop("exclusiveMinimum", None)
                branch["minimum"] = overhead_s
    return doc


def _model_limit(model: str, limit: int, tokens: list[str], default: bool) -> dict:
    """If the request is for ``model`` (by name, or by naming none when it is the default),
    its token budgets are at most ``limit``."""
    named: dict[str, Any] = {"properties": {"model": {"const": model}}, "required": ["model"]}
    unnamed = [{"not": {"required": ["model"]}}, {"properties": {"model": {"type": "null"}}, "required": ["model"]}]
    return {
        "if": {"anyOf": [named, *unnamed]} if default else named,
        "then": {"properties": {name: {"maximum": limit} for name in tokens}},
    }


def _branches(prop: dict) -> list[dict]:
    return [b for b in prop.get("anyOf", [prop]) if isinstance(b, dict)]


def one_board_query(doc: dict) -> None:
    """The leaderboard's query parameters as one object that refuses `style_control` with `category`."""
    op = doc.get("paths", {}).get(BOARD, {}).get("get")
    if op is None:
        return
    params = {p["name"]: p for p in op.get("parameters", []) if p.get("in") == "query"}
    properties: dict[str, Any] = {}
    for name, p in params.items():
        prop = {k: v for k, v in p["schema"].items() if k != "title"}
        if name == "category":  # a name or absent; the query string has no null
            prop = {"type": "string", **{k: v for k, v in prop.items() if k != "anyOf"}}
        properties[name] = prop
    query = {
        "name": "board",
        "in": "query",
        "style": "form",
        "explode": True,
        "description": "Which board: ?style_control=true, ?category=NAME (not both), ?format=csv.",
        "schema": {
            "type": "object",
            "properties": properties,
            "not": {"required": ["style_control", "category"], "properties": {"style_control": {"const": True}}},
        },
    }
    op["parameters"] = [p for p in op.get("parameters", []) if p.get("in") != "query"] + [query]
