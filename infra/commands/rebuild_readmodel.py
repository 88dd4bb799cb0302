"""`arena rebuild-readmodel`: refill Redis's read model (pending records, results) from the stream."""

from __future__ import annotations

import argparse
import asyncio
from datetime import UTC, datetime

from events.readmodel import ReadModel
from infra.audit import parse_window
from infra.commands import reach
from infra.settings import OperatorSettings
from runtime.recovery import rebuild
from runtime.redis import masked, redis_client
from runtime.settings import CommonSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("rebuild-readmodel", help="refill Redis's results and pending records from the stream")
    p.set_defaults(run=run)
    p.add_argument("--since", default="7d", help="window, e.g. 1h, 2d (default: the stream's retention)")
    reach.add_options(p, redis=True)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_rebuild(args))


async def _rebuild(args: argparse.Namespace) -> int:
    url = args.redis_url or OperatorSettings().redis_url or reach.endpoints(args.state_dir).get("redis_url")
    if not url:
        raise SystemExit("no Redis to rebuild: pass --redis-url (or REDIS_URL), or run `arena up`")
    store = ReadModel(redis_client(url), CommonSettings().result_ttl_s)
    since = datetime.now(UTC) - parse_window(args.since)
    try:
        async with reach.stream(args) as js:
            counts = await rebuild(js, store, since)
    finally:
        await store.redis.aclose()
    print(f"rebuilt from the stream: {counts['requests']} requests, {counts['results']} results, into {masked(url)}")
    return 0
