"""`arena filter-train ...`: train the prompt filter's classifier stage. Its own parser
reads its options (`main`); the one registered here only lists it in `arena --help`."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "filter-train", help="train the prompt filter's classifier stage (see --help)", add_help=False
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return main([])


def main(argv: list[str]) -> int:
    from lab.filter.train_command import main as train  # noqa: PLC0415 - scikit-learn: only training needs it

    return train(argv)
