"""What the worker holds of a model's engine: a :class:`Runner`, whichever backend it
steps (the built-in batch engine, llama.cpp, an upstream server) and wherever (a thread
beside the event loop, a process of its own). The worker never asks which: one factory
(`factory.py`) builds the runner for a loaded model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from consumers.inference.engine_io import GenRequest
    from consumers.inference.model_loading import LoadedModel
    from events.fleet import EngineLoad


class Runner(Protocol):
    """Steps one model version's engine and hands its outputs to the event loop (the
    ``on_outputs`` callback it was built with, called on the loop)."""

    name: str
    """The model's name (its spec's)."""

    @property
    def loaded(self) -> LoadedModel:
        """The model version it steps."""
        ...

    def add(self, req: GenRequest) -> None:
        """Queue a request; raises what the engine refuses it for (consumers.inference.errors)."""
        ...

    def cancel(self, request_id: str) -> None:
        """End a request it holds (a no-op for one it does not)."""
        ...

    def finish_at(self, tokens: int) -> float | None:
        """When a request of ``tokens`` tokens added now would end, at the speed measured
        (None: nothing measured yet)."""
        ...

    def load(self) -> EngineLoad:
        """What it holds and its measured step times, as heartbeats carry them."""
        ...

    def wait_ready(self, timeout: float) -> bool:
        """Wait until it serves (its profile ended, its process answered); True if it does."""
        ...

    def available(self) -> bool:
        """False while it refuses every request (an upstream's open circuit)."""
        ...

    def stop(self) -> None:
        """End its engine (its thread, its process); it steps nothing after."""
        ...
