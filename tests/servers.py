"""Where the tests' nats-server and redis-server come from.

By default, real processes on free ports (`infra.servers`: what CI and these machines
use; there is no Docker engine here). With `ARENA_TEST_SERVERS=containers` and a
reachable Docker engine, the fixtures that only need a URL start the same servers as
containers through testcontainers (`pip install -e ".[containers]"`). Tests that kill,
restart or cluster servers always use processes: they need the process itself.

The container path is not exercised on these machines (no Docker engine).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.servers import LocalServer, start_nats, start_redis

NATS_IMAGE, REDIS_IMAGE = "nats:2.11-alpine", "redis:7-alpine"


def containers() -> bool:
    return os.environ.get("ARENA_TEST_SERVERS", "processes") == "containers"


@dataclass
class ContainerServer:
    """A server in a container, with what the tests read of a LocalServer."""

    name: str
    container: Any
    port: int
    url: str

    def stop(self) -> None:
        self.container.stop()


def _container(name: str, image: str, port: int, scheme: str, suffix: str, *command: str) -> ContainerServer:
    from testcontainers.core.container import DockerContainer  # the `containers` extra
    from testcontainers.core.waiting_utils import wait_for_logs

    container = DockerContainer(image).with_exposed_ports(port)
    if command:
        container = container.with_command(" ".join(command))
    container.start()
    wait_for_logs(container, "Server is ready" if name == "nats" else "Ready to accept connections", timeout=30)
    host, mapped = container.get_container_host_ip(), int(container.get_exposed_port(port))
    return ContainerServer(name, container, mapped, f"{scheme}://{host}:{mapped}{suffix}")


def nats_for_tests(store: Path) -> LocalServer | ContainerServer:
    return _container("nats", NATS_IMAGE, 4222, "nats", "", "-js") if containers() else start_nats(store)


def redis_for_tests(data: Path) -> LocalServer | ContainerServer:
    return _container("redis", REDIS_IMAGE, 6379, "redis", "/0") if containers() else start_redis(data)
