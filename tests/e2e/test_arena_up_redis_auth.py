"""`arena up` with its per-role Redis users: an anonymous client is refused, the gateway's
user cannot write a result, every role still does its work (a chat answered over each API,
a vote counted by the leaderboard), the operator's tools work, a kill -9 of the
redis-server keeps the users, and no password is printed or logged."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import time

import httpx
import psutil
import pytest
import redis
import websockets
from redis.connection import parse_url

from events import topology
from events.readmodel import RESULT
from tests.arena_up import ArenaUp, arena, battle_and_vote

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CHAT = {"max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Once upon a time"}]}


def role_urls(up: ArenaUp) -> dict[str, str]:
    """The REDIS_URL each role's process was started with."""
    out = {}
    for child in psutil.Process(up.proc.pid).children():
        cmd = child.cmdline()
        if "run" in cmd and cmd[-1] in topology.role_names():
            out[cmd[-1]] = child.environ()["REDIS_URL"]
    return out


def anonymous_refused(port: int) -> str:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "SET", "x", "1"], capture_output=True, text=True, timeout=10, check=False
    )
    assert "NOAUTH" in out.stdout + out.stderr, out
    return out.stdout.strip()


def forging_refused(gateway_url: str) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError), redis.Redis.from_url(gateway_url) as gateway:
        gateway.set(RESULT.format("forged"), '{"type": "chat.completed"}')


async def ws_turn(url: str) -> dict:
    async with websockets.connect(f"{url.replace('http://', 'ws://')}/v1/ws") as sock:
        json.loads(await sock.recv())  # the session
        await sock.send(json.dumps({"type": "turn", "content": "A cat", "max_tokens": 8, "temperature": 0}))
        while (frame := json.loads(await asyncio.wait_for(sock.recv(), 30)))["type"] == "chunk":
            pass
        return frame


def test_up_gives_each_role_its_own_redis_user_and_refuses_anonymous_clients(tmp_path):
    up = ArenaUp(tmp_path, ready_s=150, env={"ARENA_RATE_LIMIT_RPM": "1000"})  # the limiter's script runs too
    state, env, url = up.state, up.env, up.url
    try:
        said = [line for line in up.lines if line.startswith("redis-server ") and " on redis://" in line]
        assert said and "per-role users: True" in said[0], up.lines
        acl = state / "redis-users.acl"
        assert stat.S_IMODE(acl.stat().st_mode) == 0o600
        operator_url = up.endpoints["redis_url"]
        assert parse_url(operator_url)["username"] == "operator"
        port = parse_url(operator_url)["port"]
        print(f"\n[anonymous] redis-cli -p {port} SET x 1 -> {anonymous_refused(port)}")

        urls = role_urls(up)
        assert set(urls) == set(topology.role_names())
        assert all(parse_url(u)["username"] == role for role, u in urls.items())
        passwords = [parse_url(u)["password"] for u in [*urls.values(), operator_url]]
        assert not any(p in acl.read_text() for p in passwords)  # hashes only
        forging_refused(urls["gateway"])

        # Every role at work: the gateway's keys (idempotency, seeds, owners, holders, rate
        # limits, admissions), delivery's results read back, the leaderboard's projection.
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "k-1"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "1000"
        again = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "k-1"}, timeout=30)
        assert again.json()["x_arena"]["request_id"] == r.json()["x_arena"]["request_id"]
        rid = httpx.post(f"{url}/chat", json={"prompt": "Tom had a ball", "max_tokens": 8}, timeout=30).json()[
            "request_id"
        ]
        end = time.monotonic() + 30
        while (polled := httpx.get(f"{url}/chat/result/{rid}", timeout=10)).status_code == 202:
            assert time.monotonic() < end
            time.sleep(0.2)
        assert polled.status_code == 200 and polled.json()["text"], polled.text
        assert asyncio.run(ws_turn(url))["type"] == "done"
        battle_and_vote(url)
        end = time.monotonic() + 30
        while httpx.get(f"{url}/arena/leaderboard", timeout=10).json().get("total_votes") != 1:
            assert time.monotonic() < end, "the leaderboard never counted the vote"
            time.sleep(0.3)

        # The operator's user, from endpoints.json, may rebuild the read model; its password is not shown.
        rebuilt = arena("rebuild-readmodel", "--since", "1h", "--state-dir", str(state), env=env)
        assert rebuilt.returncode == 0 and "operator:***@" in rebuilt.stdout, rebuilt.stdout + rebuilt.stderr

        # No role was refused anything: the server's ACL log holds only the forgery tried above.
        with redis.Redis.from_url(operator_url) as operator:
            refusals = {(e["username"], e["reason"], e["object"]) for e in operator.acl_log()}
        assert refusals == {("gateway", "key", RESULT.format("forged"))}, refusals

        # A kill -9 of the redis-server: the supervisor restarts it with the same ACL file.
        [server] = [p for p in psutil.Process(up.proc.pid).children() if p.name() == "redis-server"]
        server.kill()
        end = time.monotonic() + 30
        while httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code != 200:
            assert time.monotonic() < end, "not serving again after the restart"
            time.sleep(0.3)
        anonymous_refused(port)
        forging_refused(urls["gateway"])
    finally:
        code = up.stop()
    assert code == 0
    printed = "".join(up.lines) + "".join(p.read_text(errors="replace") for p in (state / "logs").glob("*.log"))
    leaked = [p for p in passwords if p in printed]
    assert not leaked, "a Redis password was printed or logged"
    assert "NOPERM" not in printed, [line for line in printed.splitlines() if "NOPERM" in line][:5]
