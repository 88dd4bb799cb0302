"""`arena replay`: every event of a request, a conversation or a battle, from the stream."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from infra.commands import reach
from runtime.stream import conversation_events, request_events


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("replay", help="print every event of a request or conversation")
    p.set_defaults(run=run)
    reach.add_options(p)
    p.add_argument("--json", action="store_true")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--request-id")
    g.add_argument("--conv-id")
    g.add_argument("--battle-id", help="the battle's events and both sides' requests")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_replay(args))


async def _replay(args: argparse.Namespace) -> int:
    async with reach.stream(args) as js:
        if args.battle_id:
            from infra import arena_cli  # noqa: PLC0415 - numpy stays out of the processes `arena run` starts

            events = await arena_cli.replay_battle(js, args.battle_id)
        elif args.request_id:
            events = await request_events(js, args.request_id)
        else:
            events = await conversation_events(js, args.conv_id)
    for e in events:
        print(e.model_dump_json() if args.json else line(e))
    if not events:
        print("no events found", file=sys.stderr)
        return 1
    return 0


def line(event) -> str:
    """One event on one line: when, what, whose, and its own fields."""
    d = event.model_dump(mode="json")
    keep = {
        k: v
        for k, v in d.items()
        if k not in ("event_id", "request_id", "conv_id", "occurred_at", "type", "schema_version")
    }
    text = json.dumps(keep, ensure_ascii=False)
    if "battle_id" in d:
        return f"{d['occurred_at']}  {event.type:<17} battle={d['battle_id']}  {text[:300]}"
    return f"{d['occurred_at']}  {event.type:<17} req={event.request_id} turn={event.turn_id}  {text[:300]}"
