"""`arena up` with its default per-role NATS users: every role runs under its own
permissions without one violation, a stranger cannot connect, the operator's tools work."""

from __future__ import annotations

import asyncio
import json
import stat
import time

import httpx
import nats
import pytest

from tests.arena_up import ArenaUp, arena, battle_and_vote

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_up_with_per_role_users_serves_and_refuses_strangers(tmp_path):
    up = ArenaUp(tmp_path, ready_s=150)
    state, env = up.state, up.env
    try:
        assert any("per-role users: True" in line for line in up.lines)
        endpoints_file = state / "endpoints.json"
        assert stat.S_IMODE(endpoints_file.stat().st_mode) == 0o600
        assert stat.S_IMODE((state / "nats-auth.conf").stat().st_mode) == 0o600
        endpoints = json.loads(endpoints_file.read_text())
        url, operator_url = endpoints["gateway_url"], endpoints["nats_url"]
        assert "operator:" in operator_url

        # Streaming: filter, inference (tokens, terminal, acks), delivery (live fan-out) and the gateway.
        body = {
            "model": "stories-260k",
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
            "messages": [{"role": "user", "content": "Once upon a time"}],
        }
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 2
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 200, r.text
        rid = r.json()["x_arena"]["request_id"]

        # A battle and a vote: the gateway's battle events, the leaderboard's durable.
        battle_and_vote(url)

        # The operator's tools use the operator's URL from endpoints.json.
        replay = arena("replay", "--request-id", rid, "--state-dir", str(state), env=env)
        assert replay.returncode == 0 and "chat.completed" in replay.stdout, replay.stderr
        models = arena("models", "list", "--state-dir", str(state), "--wait", "5", env=env)
        assert models.returncode == 0 and "stories-260k" in models.stdout, models.stderr

        async def stranger() -> None:
            plain = operator_url.split("@", 1)[1]
            await nats.connect(f"nats://{plain}", allow_reconnect=False, connect_timeout=2)

        with pytest.raises(Exception, match=r"(?i)authorization"):
            asyncio.run(stranger())
        time.sleep(1.5)  # heartbeats and the leaderboard's pulls keep going
        log = (state / "logs" / "nats-server.log").read_text()
        assert "Permissions Violation" not in log, [x for x in log.splitlines() if "Permissions" in x][:5]
    finally:
        code = up.stop()
    assert code == 0
