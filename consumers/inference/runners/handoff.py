"""Outputs on their way from an engine's stepping thread to the event loop: one wake-up
of the loop carries every step's outputs that piled up before it ran (a wake-up is a
syscall and a GIL hand-off)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from consumers.inference.engine_io import StepOutput


class Handoff:
    """``post`` from any thread; ``on_outputs`` is called on ``loop``, in step order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_outputs: Callable[[list[StepOutput]], None]) -> None:
        self.loop = loop
        self.on_outputs = on_outputs
        self._lock = threading.Lock()
        self._outputs: list[StepOutput] = []
        self._posted = False

    def post(self, outputs: list[StepOutput]) -> None:
        with self._lock:
            self._outputs += outputs
            if self._posted:
                return
            self._posted = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        """On the loop: every output posted since the last delivery, in step order."""
        with self._lock:
            outputs, self._outputs, self._posted = self._outputs, [], False
        self.on_outputs(outputs)
