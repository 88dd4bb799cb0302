"""`arena filter-eval FILE`: measure the prompt filter on a labelled JSONL file."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("filter-eval", help="measure the prompt filter on a labelled JSONL file")
    p.set_defaults(run=run)
    p.add_argument("file")
    p.add_argument("--json", action="store_true")
    p.add_argument("--classifier", default=None, help="classifier artifact (default: the committed one; 'none')")


def run(args: argparse.Namespace) -> int:
    from lab.filter.evaluate import main  # noqa: PLC0415 - an offline tool: not in the processes' imports

    extra = ["--classifier", args.classifier] if args.classifier else []
    return main([args.file] + (["--json"] if args.json else []) + extra)
