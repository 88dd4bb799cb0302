"""The fleet as this gateway's heartbeats show it (`Pipeline.fleet()`): what serving,
readiness, the arena and the fleet's series read, as one small typed value."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FleetView:
    """Ready processes per role, and which inference instances hold each model."""

    #: Ready processes per role (every role but the gateway's), from their live heartbeats.
    ready: Mapping[str, int]
    #: Each model a worker serves -> the instances holding it resident (none: listed, not loaded).
    models: Mapping[str, list[str]] = field(default_factory=dict)
    #: A model -> the instances loading it now.
    loading: Mapping[str, list[str]] = field(default_factory=dict)
    #: A model -> the instances that cannot serve it now (its upstream's circuit is open).
    unavailable: Mapping[str, list[str]] = field(default_factory=dict)

    def count(self, role: str) -> int:
        """The role's ready processes (0 for one never heard)."""
        return self.ready.get(role, 0)

    def loading_everywhere(self, model: str) -> bool:
        """Some worker is loading the model and none holds it ready."""
        return self._everywhere(model, self.loading)

    def down_everywhere(self, model: str) -> bool:
        """The model's upstream is down wherever it is held."""
        return self._everywhere(model, self.unavailable)

    def _everywhere(self, model: str, at: Mapping[str, list[str]]) -> bool:
        where = at.get(model, [])
        return bool(where) and not set(self.models.get(model, ())) - set(where)

    def as_dict(self) -> dict[str, Any]:
        """The shape /readyz has always shown: a count per role, then models, loading, unavailable."""
        return {
            **self.ready,
            "models": dict(self.models),
            "loading": dict(self.loading),
            "unavailable": dict(self.unavailable),
        }
