"""A `redis+sentinel://` URL against a real Redis master, replica and Sentinel: the client
finds the master through Sentinel, and after the master is killed and Sentinel promotes
the replica, the same client writes to the new master (what a Redis failover looks like
to every arenaflow process)."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from infra.servers import redis_server_binary, start_redis, wait_port
from runtime.net import free_port
from runtime.redis import REDIS_DOWN, redis_client
from tests import waiting

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def spawn(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen([redis_server_binary(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_port(port, proc)
    return proc


async def until(predicate, timeout: float, what: str):
    return await waiting.until(predicate, timeout, what, every=0.2, ignoring=REDIS_DOWN)


async def test_sentinel_url_finds_the_master_and_follows_a_failover(tmp_path):
    master = start_redis(tmp_path / "master")
    replica_port, sentinel_port = free_port(), free_port()
    (tmp_path / "replica").mkdir()
    replica_args = [
        "--bind",
        "127.0.0.1",
        "--port",
        str(replica_port),
        "--save",
        "",
        "--dir",
        str(tmp_path / "replica"),
    ]
    replica = spawn([*replica_args, "--replicaof", "127.0.0.1", str(master.port)], replica_port)
    direct = redis_client(f"redis://127.0.0.1:{replica_port}/0")
    sentinel = None
    client = None
    try:
        # Synced before Sentinel starts, so its first look at the master sees the replica.
        await until(lambda: _link_up(direct), 20, "the replica to sync")
        conf = tmp_path / "sentinel.conf"
        conf.write_text(
            f"port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor arena 127.0.0.1 {master.port} 1\n"
            "sentinel down-after-milliseconds arena 1000\nsentinel failover-timeout arena 10000\n"
        )
        sentinel = spawn([str(conf), "--sentinel"], sentinel_port)

        client = redis_client(f"redis+sentinel://127.0.0.1:{sentinel_port}/arena/0")
        await client.set("arena:k", "before")
        assert await client.connection_pool.get_master_address() == ("127.0.0.1", master.port)

        master.proc.send_signal(signal.SIGKILL)
        master.proc.wait()
        started = time.monotonic()
        await until(lambda: client.set("arena:k2", "after"), 40, "a write after the failover")
        took = time.monotonic() - started
        assert await client.connection_pool.get_master_address() == ("127.0.0.1", replica_port)
        assert await client.get("arena:k") == b"before"  # replicated before the kill
        assert await direct.get("arena:k2") == b"after"  # written to the promoted replica
        print(f"\n[sentinel] writes resumed {took:.1f} s after the master was killed")
    finally:
        for c in (client, direct):
            if c is not None:
                await c.aclose()
        for proc in (sentinel, replica):
            if proc is not None:
                proc.kill()
                proc.wait()
        master.stop()


async def _link_up(client) -> bool:
    info = await client.info("replication")
    return info.get("master_link_status") == "up"
