"""`arena topology`: what a process with per-role permissions may not do; the operator
creates the stream and the durables (a Job on Kubernetes)."""

from __future__ import annotations

import argparse
import asyncio

from events import subjects
from events import topology as roles
from runtime import jetstream
from runtime.settings import CommonSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("topology", help="create or update the stream and the durables (NATS_URL, ARENA_NATS_*)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_topology())


async def _topology() -> int:
    settings = CommonSettings()
    nc = await jetstream.connect(settings.nats_url, "arena-topology", **jetstream.connect_options(settings))
    try:
        await jetstream.ensure_topology(nc.jetstream(), settings.retention_days, **settings.topology())
    finally:
        await nc.close()
    print(f"stream {subjects.STREAM} and durables {[r.durable for r in roles.consumers()]} in place")
    return 0
