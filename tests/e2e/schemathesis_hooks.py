"""Schemathesis hooks for tests/e2e/test_edge_api.py (SCHEMATHESIS_HOOKS=tests.e2e.schemathesis_hooks).

The served document says what is accepted (gateway/served_schema.py) but for one limit no
static document can say: whether a request's token budget, at the served model's measured
speed, can finish within its deadline. It couples two fields with a figure the gateway
learns while serving; deadline_s's description states it, and the 400 names the field."""

from __future__ import annotations

import schemathesis

#: Deadlines under this may be too short for a budget of up to 511 tokens of stories-260k (the
#: stack's models, about 1 ms a token, times admission's margin) after the 0.5 s overhead; a
#: `deadline_too_short` on a longer one is a failure like any other.
SPEED_BOUND_S = 2.0


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    """Keep every failure but that one: a schema-valid request with a deadline under
    SPEED_BOUND_S answered 400 `deadline_too_short`."""
    if type(failure).__name__ != "RejectedPositiveData" or response.status_code != 400:
        return True
    deadline = case.body.get("deadline_s") if isinstance(case.body, dict) else None
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return True
    return not (code == "deadline_too_short" and isinstance(deadline, int | float) and deadline < SPEED_BOUND_S)
