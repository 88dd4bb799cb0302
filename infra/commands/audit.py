"""`arena audit`: did every request in the window reach exactly one terminal event, and
every vote count once?"""

from __future__ import annotations

import argparse
import asyncio
import json

from infra.audit import audit_window, parse_window
from infra.commands import reach


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("audit", help="check every request reached exactly one terminal event")
    p.set_defaults(run=run)
    reach.add_options(p)
    p.add_argument("--json", action="store_true")
    p.add_argument("--since", default="1h", help="window, e.g. 30m, 1h, 2d")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_audit(args))


async def _audit(args: argparse.Namespace) -> int:
    async with reach.stream(args) as js:
        report = await audit_window(js, parse_window(args.since))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_text(report))
    return 0 if report["ok"] else 1


def _text(report: dict) -> str:
    lines = [
        f"requests: {report['requests']}  in flight: {len(report['in_flight'])}",
        f"missing terminal event: {len(report['missing_terminal'])}",
        *(f"  {r}" for r in report["missing_terminal"]),
        f"more than one terminal event: {len(report['duplicate_terminal'])}",
        *(f"  {r}" for r in report["duplicate_terminal"]),
        f"battles: {report['battles']}  votes: {report['votes']}",
    ]
    for key in ("votes_without_battle", "battles_with_several_votes"):
        lines.append(f"{key.replace('_', ' ')}: {len(report[key])}")
        lines += [f"  {b}" for b in report[key]]
    for rule, battles in report["votes_not_counted"].items():
        lines.append(f"votes not counted ({rule}): {len(battles)}  {' '.join(battles[:10])}")
    lines.append("OK" if report["ok"] else "PROBLEMS FOUND")
    return "\n".join(lines)
