"""The `arena` command: one module per subcommand in `infra.commands`, registered here."""

from __future__ import annotations

import argparse
import os
import sys

from infra.commands import COMMANDS, filter_train

#: Subcommands whose own parser reads the words after their name.
RAW = {"filter-train": filter_train.main}


class Parser(argparse.ArgumentParser):
    """No abbreviated options, in `arena` and every subcommand (subparsers are of their
    parent's class): `arena up --model X` must never be taken for `--models-config X`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="arena", description="arenaflow: LLM serving on NATS JetStream")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """`arena`: a command whose reader went away (`arena audit | head`) ends quietly, as
    a Unix tool does, instead of with a BrokenPipeError traceback."""
    try:
        rc = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe: point stdout at /dev/null so the interpreter's final
        # flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool ended by a closed pipe
    return rc


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in RAW:
        return RAW[argv[0]](argv[1:])
    args = parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
