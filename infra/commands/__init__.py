"""The `arena` command's subcommands, one module each (as vLLM's `CLISubcommand`).

Each module has `register(subparsers)`, which adds its parser and sets `run` on it, and
`run(args) -> int`, the exit status. `infra.cli` registers them in the order of
`COMMANDS`, which is the order `arena --help` lists them in. A command whose own parser
reads its arguments (`filter-train`) also has `main(argv)`, called with the raw words.
"""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Protocol

from infra.commands import (
    asyncapi,
    audit,
    battles,
    filter_eval,
    filter_train,
    leaderboard,
    models,
    rebuild_readmodel,
    replay,
    run,
    top,
    topology,
    up,
)


class Command(Protocol):
    """What a subcommand module provides."""

    def register(self, subparsers: argparse._SubParsersAction) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


COMMANDS: tuple[ModuleType, ...] = (
    up,
    topology,
    run,
    replay,
    audit,
    rebuild_readmodel,
    filter_eval,
    filter_train,
    models,
    leaderboard,
    battles,
    top,
    asyncapi,
)
