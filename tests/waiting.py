"""Waiting for a condition in a test: one polling loop, async or blocking, that returns what
the check gave and fails saying what it saw. Where a signal exists (an event, a future, a
subscription), wait on it instead."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


async def until(
    check: Callable[[], Any],
    timeout: float = 5.0,
    what: str | Callable[[], Any] = "timed out",
    every: float = 0.02,
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """Poll `check()` (or the awaitable it returns) every `every` s until it is truthy and
    return it; exceptions of `ignoring` count as not yet. Past `timeout` s, fail with
    `what` (a string, or a function whose result, awaited if need be, says what was seen)."""
    end = time.monotonic() + timeout
    while True:
        try:
            if result := await _value(check()):
                return result
        except ignoring:
            pass
        if time.monotonic() >= end:
            seen = what if isinstance(what, str) else await _value(what())
            raise AssertionError(f"not within {timeout} s: {seen}")
        await asyncio.sleep(every)


def wait_for(
    check: Callable[[], Any],
    timeout: float,
    what: str,
    every: float = 0.5,
    ignoring: tuple[type[BaseException], ...] = (),
) -> Any:
    """The blocking `until`: the last value or exception seen goes into the failure."""
    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        try:
            if last := check():
                return last
        except ignoring as exc:
            last = exc
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s (last: {last})")
