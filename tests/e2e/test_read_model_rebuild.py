"""Redis loses its data: completed answers are still served (rebuilt from the stream for
one request on demand) and `arena rebuild-readmodel` refills the whole read model."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
import redis

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_results_survive_a_redis_wipe(stack):
    client = redis.Redis.from_url(stack.redis.url)
    ids = []
    for i, prompt in enumerate(("Once upon a time", "The little cat", "Tom had a red ball")):
        r = httpx.post(f"{stack.url}/chat", json={"prompt": prompt, "max_tokens": 48, "temperature": 0}, timeout=30)
        assert r.status_code == 202
        ids.append(r.json()["request_id"])
        if i == 1:
            client.flushall()  # under load: two requests are running, one not yet sent
    answers = {}
    end = time.monotonic() + 60
    while len(answers) < len(ids) and time.monotonic() < end:
        for rid in ids:
            r = httpx.get(f"{stack.url}/chat/result/{rid}", timeout=10)
            if r.status_code == 200:
                answers[rid] = r.json()["text"]
        time.sleep(0.2)
    assert len(answers) == 3  # the ones running during the wipe too

    client.flushall()
    r = httpx.get(f"{stack.url}/chat/result/{ids[0]}", timeout=10)
    assert r.status_code == 200 and r.json()["text"] == answers[ids[0]]  # from the stream, on demand
    assert client.exists(f"arena:result:{ids[0]}") and not client.exists(f"arena:result:{ids[1]}")

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "rebuild-readmodel",
            "--since",
            "1h",
            "--nats-url",
            stack.nats.url,
            "--redis-url",
            stack.redis.url,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "3 requests, 3 results" in out.stdout, out.stdout
    for rid in ids:
        assert client.exists(f"arena:result:{rid}") and client.exists(f"arena:pending:{rid}")
        assert httpx.get(f"{stack.url}/chat/result/{rid}", timeout=10).json()["text"] == answers[rid]
    assert httpx.get(f"{stack.url}/chat/result/nope0000", timeout=10).status_code == 404
    client.close()
