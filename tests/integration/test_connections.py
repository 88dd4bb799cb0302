"""Every process of the stack opens one NATS connection, the one it uses: counted by the
nats-server itself (its /connz monitoring endpoint), matched to the processes by the
client ports each one holds. (Until the consumers stopped building a FastStream broker
they never subscribed with, each consumer held a second, idle one.)"""

from __future__ import annotations

import time

import httpx
import psutil
import pytest

from infra.servers import start_nats
from runtime.net import free_port
from tests.conftest import ROLES, RunningStack
from tests.servers import redis_for_tests

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def monitored_nats(tmp_path):
    """A nats-server with its HTTP monitoring endpoint on a port of its own."""
    monitor = free_port()
    config = tmp_path / "nats.conf"
    config.write_text(f"http: 127.0.0.1:{monitor}\n")
    server = start_nats(tmp_path / "nats", config=config)
    server.monitor_url = f"http://127.0.0.1:{monitor}"  # type: ignore[attr-defined]
    yield server
    server.stop()


def client_ports(pid: int, server_port: int) -> set[int]:
    """The local ports of the TCP connections `pid` and its children (engine processes)
    hold to the server."""
    ports = set()
    root = psutil.Process(pid)
    for proc in (root, *root.children(recursive=True)):
        for conn in proc.net_connections("tcp"):
            if conn.raddr and conn.raddr.port == server_port:
                ports.add(conn.laddr.port)
    return ports


def connections_by_process(stack: RunningStack, nats) -> tuple[dict[str, list[dict]], list[dict]]:
    """Each process's connections as the server lists them, and every connection listed."""
    listed = httpx.get(f"{nats.monitor_url}/connz", params={"limit": 1024, "subs": 1}, timeout=5).json()["connections"]
    per_process = {}
    for name, proc in stack.stack.procs.items():
        ports = client_ports(proc.pid, nats.port)
        per_process[name] = [c for c in listed if c["port"] in ports]
    return per_process, listed


def test_each_process_opens_one_nats_connection_and_uses_it(tmp_path, monitored_nats):
    redis = redis_for_tests(tmp_path / "redis")
    stack = RunningStack(tmp_path / "stack", monitored_nats, redis)
    try:
        stack.start()
        time.sleep(1.5)  # a few heartbeats from every process on its connection
        per_process, listed = connections_by_process(stack, monitored_nats)
        print({name: len(conns) for name, conns in per_process.items()}, f"{len(listed)} listed in all")
        assert set(per_process) == set(ROLES)
        for name, conns in per_process.items():
            assert len(conns) == 1, (name, conns)
            (conn,) = conns
            assert conn["name"] == f"arena-{name}", conn
            assert conn["in_msgs"] > 0, conn  # it publishes (heartbeats at least): not an idle connection
        # and no connection on the server that no process of the stack holds
        assert len(listed) == len(ROLES), listed
        consumers = [name for name in ROLES if name != "gateway"]
        for name in consumers:  # each pulls its durable on that same connection
            (conn,) = per_process[name]
            assert conn["subscriptions"] >= 1, conn  # a count; `subs=1` lists them in subscriptions_list
    finally:
        stack.stop()
        redis.stop()
