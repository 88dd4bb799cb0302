"""`arena asyncapi`: the AsyncAPI document of the event contract (see `infra.asyncapi`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from infra.asyncapi import schema_json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("asyncapi", help="write the AsyncAPI document of the event contract")
    p.set_defaults(run=run)
    p.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    text = schema_json()
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0
