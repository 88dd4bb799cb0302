"""`arena top`: a live view of a running `arena up`, per model, per durable, per process."""

from __future__ import annotations

import argparse

from infra.settings import OperatorSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("top", help="live view of a running `arena up`: per model, per durable, per process")
    p.set_defaults(run=run)
    p.add_argument("--state-dir", default=OperatorSettings().state_dir)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (rates are over it)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--svg", default=None, help="with --once: also save the frame as an SVG screenshot")
    p.add_argument("--width", type=int, default=120, help="with --once: columns of the frame")


def run(args: argparse.Namespace) -> int:
    from infra.monitoring import top  # noqa: PLC0415 - rich stays out of the processes `arena run` starts

    return top.run(args.state_dir, args.interval, args.once, args.svg, args.width)
