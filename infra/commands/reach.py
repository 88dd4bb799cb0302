"""How the operator commands reach a stack: the NATS and Redis URLs from the flag, the
environment, then the `endpoints.json` a running `arena up` wrote in the state dir."""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlparse

import nats
from nats.js import JetStreamContext

from infra.servers import start_nats
from infra.settings import OperatorSettings
from runtime import jetstream


def add_options(parser: argparse.ArgumentParser, redis: bool = False) -> None:
    """--nats-url (and --redis-url) and --state-dir, as every command that reads the stream takes them."""
    parser.add_argument("--nats-url", default=None)
    if redis:
        parser.add_argument("--redis-url", default=None)
    parser.add_argument("--state-dir", default=OperatorSettings().state_dir)


def endpoints(state_dir: str) -> dict:
    path = Path(state_dir) / "endpoints.json"
    return json.loads(path.read_text()) if path.exists() else {}


def nats_url(args: argparse.Namespace) -> str | None:
    return args.nats_url or OperatorSettings().nats_url or endpoints(args.state_dir).get("nats_url")


def reachable(url: str) -> bool:
    """Any of the servers in `url` (comma-separated for a cluster) answers on its port."""
    for one in jetstream.servers(url):
        parsed = urlparse(one)
        try:
            with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout=1):
                return True
        except OSError:
            continue
    return False


async def connect(url: str, **options) -> nats.NATS:
    """The operator's connection (its user and TLS, where set), no reconnects."""
    return await nats.connect(
        jetstream.servers(url), allow_reconnect=False, **options, **jetstream.connect_options(OperatorSettings())
    )


@asynccontextmanager
async def stream(args: argparse.Namespace) -> AsyncIterator[JetStreamContext]:
    """The stream to read: --nats-url, NATS_URL, a running `arena up`, or (when it is
    stopped) a temporary nats-server on the store `arena up` left behind."""
    url = nats_url(args)
    server = None
    nc = None
    if url and reachable(url):
        nc = await connect(url, connect_timeout=2)
    if nc is None:
        store = Path(args.state_dir) / "nats"
        if not store.exists():
            raise SystemExit(f"no NATS server reachable and no stored stream at {store}; pass --nats-url")
        server = start_nats(store)
        nc = await nats.connect(server.url)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()
        if server:
            server.stop()
