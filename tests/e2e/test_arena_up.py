"""`arena up` as a user runs it: one command up, a request, replay, audit, and a clean stop."""

from __future__ import annotations

import json

import httpx
import psutil
import pytest

from tests.arena_up import ArenaUp, arena

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_up_serves_replays_audits_and_stops_cleanly(tmp_path):
    up = ArenaUp(tmp_path, ready_s=150)
    state, env, url = up.state, up.env, up.url
    try:
        children = psutil.Process(up.proc.pid).children(recursive=True)
        assert len(children) >= 6  # nats, redis, filter, delivery, inference, gateway

        r = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=30,
            json={
                "model": "stories-260k",
                "max_tokens": 12,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Once upon a time"}],
            },
        )
        assert r.status_code == 200, r.text
        rid = r.json()["x_arena"]["request_id"]

        replay = arena("replay", "--request-id", rid, "--state-dir", str(state), env=env)
        assert replay.returncode == 0, replay.stderr
        kinds = [line.split()[1] for line in replay.stdout.splitlines()]
        assert kinds[0] == "chat.requested" and kinds[-1] == "chat.completed"
        assert "tokens.generated" in kinds

        audit = arena("audit", "--since", "1h", "--state-dir", str(state), "--json", env=env)
        report = json.loads(audit.stdout)
        assert audit.returncode == 0 and report["ok"] and report["requests"] == 1
    finally:
        code = up.stop()
    assert code == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "left processes behind"

    # The stream outlives the stack: replay reads the store it left.
    again = arena("replay", "--request-id", rid, "--state-dir", str(state), env=env)
    assert again.returncode == 0 and "chat.completed" in again.stdout
