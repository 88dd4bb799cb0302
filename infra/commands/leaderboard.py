"""`arena leaderboard`: the arena leaderboard recomputed from the stream (or every model's history)."""

from __future__ import annotations

import argparse
import asyncio

from infra.commands import reach


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("leaderboard", help="recompute the arena leaderboard from the stream")
    p.set_defaults(run=run)
    p.add_argument("--at", type=int, default=None, help="stream sequence to stop at (same digest as then)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--style-control", action="store_true", help="ratings with answer length and markdown taken out (LMArena's)"
    )
    p.add_argument("--category", metavar="NAME", help="the board of one category's votes (coding, math, english, ...)")
    p.add_argument(
        "--history",
        action="store_true",
        help="every model that ever entered, withdrawn ones included, with its owner and votes; variants per owner",
    )
    reach.add_options(p)


def run(args: argparse.Namespace) -> int:
    if args.history and (args.style_control or args.category):
        raise SystemExit("arena leaderboard --history lists models, not ratings: no --style-control or --category")
    return asyncio.run(_leaderboard(args))


async def _leaderboard(args: argparse.Namespace) -> int:
    from infra import arena_cli  # noqa: PLC0415 - numpy stays out of the processes `arena run` starts

    async with reach.stream(args) as js:
        if args.history:
            return await arena_cli.history(js, args.at, args.json)
        return await arena_cli.leaderboard(js, args.at, args.json, args.style_control, args.category)
