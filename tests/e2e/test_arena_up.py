"""`arena up` as a user runs it: one command up, a request, replay, audit, and a clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.conftest import REPO, SHARED

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def arena(*args, env, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_up_serves_replays_audits_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_") and k not in ("NATS_URL", "REDIS_URL")}
    env.update({"ARENA_MODELS_DIR": str(SHARED / "models"), "HF_HUB_OFFLINE": "1"})
    state = tmp_path / "state"
    up = subprocess.Popen(
        [sys.executable, "-m", "infra.cli", "up", "--port", "0", "--state-dir", str(state)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        end = time.monotonic() + 150
        while time.monotonic() < end:
            line = up.stdout.readline()
            lines.append(line)
            if "ready at" in line or up.poll() is not None:
                break
        assert any("ready at" in line for line in lines), "".join(lines)
        url = json.loads((state / "endpoints.json").read_text())["gateway_url"]
        children = psutil.Process(up.pid).children(recursive=True)
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
        up.send_signal(signal.SIGTERM)
        up.wait(60)
    assert up.returncode == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], "left processes behind"

    # The stream outlives the stack: replay reads the store it left.
    again = arena("replay", "--request-id", rid, "--state-dir", str(state), env=env)
    assert again.returncode == 0 and "chat.completed" in again.stdout
