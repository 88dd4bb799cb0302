"""JetStream's fsync policy reaches nats-server: the configuration `arena up` writes,
loaded by a real nats-server, is what the server's monitoring endpoint (/varz) reports."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from infra import nats_auth
from infra.servers import nats_server_binary, nats_server_config, nats_sync, wait_port
from runtime.net import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def varz_of(config: Path, store: Path) -> dict:
    """/varz of a nats-server started with `config` (and a monitoring port of its own)."""
    port, monitor = free_port(), free_port()
    cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "-js", "-sd", str(store)]
    proc = subprocess.Popen([*cmd, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_port(monitor, proc)
        return httpx.get(f"http://127.0.0.1:{monitor}/varz", timeout=5).json()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("policy", "always", "interval_s"), [("always", True, None), ("10s", False, 10), ("2m", False, 120)]
)
def test_the_sync_policy_is_the_one_nats_server_runs_with(tmp_path, policy, always, interval_s):
    (tmp_path / "nats-auth.conf").write_text(nats_auth.server_config(nats_auth.new_passwords()))
    config = tmp_path / "nats-server.conf"
    config.write_text(nats_server_config(policy, include="nats-auth.conf"))

    varz = varz_of(config, tmp_path / "store")
    assert varz["jetstream"]["config"].get("sync_always", False) is always
    if interval_s is not None:
        assert varz["jetstream"]["config"]["sync_interval"] == interval_s * 1_000_000_000
    assert varz["auth_required"] is True  # the included users are in force beside it


@pytest.mark.parametrize("bad", ["soon", "2 min", "", "-1s", "always,2m"])
def test_a_policy_nats_server_would_not_read_is_refused_with_what_to_write(bad):
    with pytest.raises(ValueError, match="'always' or a duration like 2m"):
        nats_sync(bad)
