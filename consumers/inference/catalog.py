"""Which models a worker's pool serves: their specs by name (a variant names its base,
whose weights it borrows) and their context lengths, read from each checkpoint's config
and then as loaded. What the pool holds in memory is the pool's own (pool.py)."""

from __future__ import annotations

from consumers.inference.errors import UnknownModel
from consumers.inference.model_loading import ModelSpec, configured_context_len


class Catalog:
    def __init__(self, specs: list[ModelSpec]) -> None:
        self.specs: dict[str, ModelSpec] = {}
        self.contexts: dict[str, int] = {}  # per plain model: from its config, then as loaded
        for spec in specs:
            self.register(spec)
            self.read_context(spec)

    def register(self, spec: ModelSpec) -> None:
        if spec.name in self.specs:
            raise ValueError(
                f"model {spec.name!r} is already configured; to replace it: arena models reload --name {spec.name}"
            )
        self.specs[spec.name] = spec

    def read_context(self, spec: ModelSpec) -> None:
        """Its context length from its checkpoint's config, unless known (reads a file)."""
        if spec.name not in self.contexts and (n := configured_context_len(spec)) is not None:
            self.contexts[spec.name] = n

    def spec(self, name: str) -> ModelSpec:
        """``name``'s spec; UnknownModel when it is not served."""
        if name not in self.specs:
            raise UnknownModel(name, sorted(self.specs))
        return self.specs[name]

    def variants(self, name: str) -> list[str]:
        """The variants of ``name`` (those whose base it is), in the order they came."""
        return [s.name for s in self.specs.values() if s.base == name]

    def context_lengths(self) -> dict[str, int]:
        """Each model's context length in tokens (prompt and completion), where known: as
        loaded, else as its checkpoint's config says; a variant's is its base's."""
        known = ((spec.name, self.contexts.get(spec.base or spec.name)) for spec in self.specs.values())
        return {name: n for name, n in known if n is not None}
