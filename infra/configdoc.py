"""The configuration page, generated: `python -m infra.configdoc` writes
`docs/configuration.md` from the settings classes' fields (environment variable, type,
default, description per process). The page is committed; `tests/unit/test_configdoc.py`
fails when it differs from what this makes, and when a field has no description."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

REPO = Path(__file__).resolve().parents[1]
PATH = REPO / "docs" / "configuration.md"


@dataclass(frozen=True)
class Section:
    title: str
    settings: type[BaseSettings]
    #: who reads it, in a sentence
    reader: str


def sections() -> tuple[Section, ...]:
    """Every settings class, in the page's order: the one list to extend when a process
    gets settings of its own (`tests/unit/test_configdoc.py` finds unlisted ones)."""
    from consumers.delivery.settings import DeliverySettings  # noqa: PLC0415 - the processes' imports, when asked
    from consumers.filter.settings import FilterSettings  # noqa: PLC0415
    from consumers.inference.settings import InferenceSettings  # noqa: PLC0415
    from consumers.leaderboard.settings import LeaderboardSettings  # noqa: PLC0415
    from gateway.settings import GatewaySettings  # noqa: PLC0415
    from infra.settings import OperatorSettings  # noqa: PLC0415
    from runtime.settings import CommonSettings  # noqa: PLC0415

    return (
        Section("Every process", CommonSettings, "Read by each role below (they share these fields)."),
        Section("gateway", GatewaySettings, "`arena run gateway`: the HTTP API, its edge, keys, admission, arena."),
        Section("filter", FilterSettings, "`arena run filter`: the prompt filter consumer."),
        Section("inference", InferenceSettings, "`arena run inference`: the model pool and batch engine."),
        Section("delivery", DeliverySettings, "`arena run delivery`: results into Redis, live fan-out."),
        Section("leaderboard", LeaderboardSettings, "`arena run leaderboard`: the arena's vote projection."),
        Section("The `arena` command", OperatorSettings, "`arena up` and the operator commands themselves."),
    )


def env_names(settings: type[BaseSettings], name: str, field: FieldInfo) -> list[str]:
    alias = field.validation_alias
    if alias is not None:
        choices = getattr(alias, "choices", [alias])
        return [str(c) for c in choices]
    return [f"{settings.model_config.get('env_prefix', '')}{name}".upper()]


def type_name(annotation: object) -> str:
    if annotation is None or annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if annotation is typing.Any:
        return "Any"
    if annotation is SecretStr:
        return "secret str"
    return getattr(annotation, "__name__", str(annotation))


def _machine_neutral(text: str) -> str:
    """Defaults computed from where the code runs, written the same on every machine."""
    if text == f"{socket.gethostname()}-{os.getpid()}":
        return "<hostname>-<pid>"
    for path, name in ((REPO, "<checkout>"), (REPO.parent, "<checkout>/.."), (Path.home(), "~")):
        if len(path.parts) > 1:
            text = text.replace(str(path), name)
    return text


def default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        # A default made from the fields before it (the models config's default model): as
        # none of them is set.
        value = field.default_factory({}) if field.default_factory_takes_validated_data else field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, list | dict):
        text = json.dumps(value)
    elif isinstance(value, BaseModel):
        text = value.model_dump_json()
    else:
        text = str(value)
    return f"`{_machine_neutral(text)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


@dataclass(frozen=True)
class Row:
    env: str
    type: str
    default: str
    description: str


def rows(settings: type[BaseSettings], skip: set[str] | None = None) -> Iterator[Row]:
    """A row per field, and one per field of a nested model (`ARENA_FILTER__REJECT_THRESHOLD`)."""
    nested = settings.model_config.get("env_nested_delimiter") or ""
    for name, field in settings.model_fields.items():
        if skip and name in skip:
            continue
        names = env_names(settings, name, field)
        yield Row(
            " or ".join(f"`{n}`" for n in names),
            type_name(field.annotation),
            default_text(field),
            field.description or "",
        )
        model = field.annotation
        if nested and isinstance(model, type) and issubclass(model, BaseModel) and not issubclass(model, BaseSettings):
            for sub, info in model.model_fields.items():
                env = f"{names[-1]}{nested}{sub.upper()}"
                yield Row(f"`{env}`", type_name(info.annotation), default_text(info), info.description or "")


def inherited(settings: type[BaseSettings], earlier: list[Section]) -> dict[str, str]:
    """Fields this class shares, unchanged, with a section listed before it: name -> that
    section's title."""
    shared: dict[str, str] = {}
    for section in earlier:
        theirs = section.settings.model_fields
        for name, field in settings.model_fields.items():
            same = name in theirs and repr(theirs[name]) == repr(field)
            if (
                same
                and name not in shared
                and env_names(settings, name, field) == env_names(section.settings, name, theirs[name])
            ):
                shared[name] = section.title
    return shared


def _anchor(title: str) -> str:
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c == "-")


def _also(cls: type[BaseSettings], shared: dict[str, str], earlier: list[Section]) -> str:
    """One sentence naming what a section shares with those above it."""
    parts = []
    for section in earlier:
        names = [n for n, title in shared.items() if title == section.title]
        if not names:
            continue
        link = f"[{section.title}](#{_anchor(section.title)})"
        if len(names) == len(section.settings.model_fields):
            parts.append(f"every variable of {link}")
            continue
        own = [n for n in section.settings.model_fields if n not in names and n in cls.model_fields]
        if own and len(own) < len(names) and len(own) + len(names) == len(section.settings.model_fields):
            envs = ", ".join(f"`{env_names(cls, n, cls.model_fields[n])[-1]}`" for n in own)
            parts.append(f"every variable of {link} but {envs} (its own, below)")
        else:
            envs = ", ".join(f"`{env_names(cls, n, cls.model_fields[n])[-1]}`" for n in names)
            parts.append(f"{envs} as in {link}")
    return "Also reads " + "; ".join(parts) + "."


HEADER = """# Configuration

<!-- GENERATED by `python -m infra.configdoc` from the settings classes' field descriptions.
     Do not edit by hand: change the field's `description` and run the command again
     (`tests/unit/test_configdoc.py` fails while this page is out of date). -->

Each process reads its settings from environment variables, once, at start, through one
pydantic-settings class; a value that cannot work stops the process with a message that
names the variable. Lists and maps are JSON (`ARENA_API_KEYS='["sk-1"]'`); a nested field
is `PARENT__FIELD` (`ARENA_FILTER__REJECT_THRESHOLD=0.8`). Names are not case-sensitive.
`arena up` passes each process what it needs (ports, URLs with per-role credentials, the
models config); the flags of `arena up` itself are in [operations](operations.md#arena-up).
"""


def render() -> str:
    out = [HEADER]
    done: list[Section] = []
    for section in sections():
        cls = section.settings
        shared = inherited(cls, done)
        out.append(f"\n## {section.title}\n\n{section.reader} `{cls.__module__}.{cls.__qualname__}`.\n")
        if shared:
            out.append(f"\n{_also(cls, shared, done)}\n")
        table = list(rows(cls, set(shared)))
        if table:
            out.append("\n| variable | type | default | description |\n|---|---|---|---|\n")
            out.extend(f"| {r.env} | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.description)} |\n" for r in table)
        done.append(section)
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.configdoc",
        description=f"Write the configuration page, generated from the settings classes, to {PATH.relative_to(REPO)}.",
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = PATH.read_text() if PATH.is_file() else ""
        if current != text:
            print(f"{PATH.relative_to(REPO)} is out of date: run python -m infra.configdoc", file=sys.stderr)
            return 1
        return 0
    PATH.write_text(text)
    print(f"wrote {PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
