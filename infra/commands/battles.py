"""`arena battles`: import or export arena votes (FastChat clean-battle JSON); invalidate
or reinstate a battle's vote (an event in the stream)."""

from __future__ import annotations

import argparse
import asyncio

from events import subjects
from infra.commands import reach


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "battles",
        help="import or export arena votes (FastChat clean-battle JSON); invalidate or reinstate a battle's vote",
    )
    p.set_defaults(run=run)
    p.add_argument("op", choices=("import", "export", "invalidate", "reinstate"))
    p.add_argument(
        "file",
        nargs="?",
        metavar="FILE|BATTLE_ID",
        help="import: the file to read; export: the file to write (default stdout); invalidate/reinstate: the battle",
    )
    p.add_argument("--reason", help="invalidate/reinstate: why (recorded on the event)")
    reach.add_options(p)


def run(args: argparse.Namespace) -> int:
    status = args.op in ("invalidate", "reinstate")
    if (status or args.op == "import") and not args.file:
        raise SystemExit(f"arena battles {args.op} needs {'a FILE' if args.op == 'import' else 'a BATTLE_ID'}")
    if status and not args.reason:
        raise SystemExit(f"arena battles {args.op} needs --reason (it is recorded on the event)")
    return asyncio.run(_battles(args))


async def _battles(args: argparse.Namespace) -> int:
    from infra import arena_cli  # noqa: PLC0415 - numpy stays out of the processes `arena run` starts

    async with reach.stream(args) as js:
        if args.op in ("invalidate", "reinstate"):
            return await arena_cli.set_vote_status(js, args.file, args.op == "reinstate", args.reason)
        if args.op == "import":
            await js.stream_info(subjects.STREAM)  # the stream must exist (arena up ran)
            return await arena_cli.import_battles(js, args.file)
        return await arena_cli.export_battles(js, args.file)
