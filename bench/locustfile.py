"""The Locust scenario: chat users asking about Chatbot Arena, with think time.

    arena up --port 8000 &
    locust -f bench/locustfile.py --headless -u 20 -r 5 -t 60s --host http://127.0.0.1:8000

Half the requests wait for the whole answer ("chat"); half stream. For a streamed
request Locust's own timing stops at the response headers ("chat (stream) headers"),
so the time to first token and to the end of the stream are reported as rows of
their own ("TTFT", "stream total"). Sized for a 2-core machine: 20 users with 0.5-2 s think time
and short answers keep a stories260K-class model busy without drowning it.

Environment: ARENA_MODEL (default "stories-260k"), ARENA_MAX_TOKENS (default 32).
"""

from __future__ import annotations

import json
import os
import time

from locust import HttpUser, between, task

PROMPT = "请用三句话介绍 Chatbot Arena"
MODEL = os.environ.get("ARENA_MODEL", "stories-260k")
MAX_TOKENS = int(os.environ.get("ARENA_MAX_TOKENS", "32"))


def _body(stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "stream": stream,
    }


def _check(resp) -> bool:
    """Mark 429s as rejections and other non-200s as errors; True when the answer is usable."""
    if resp.status_code == 429:
        resp.failure("rejected (429)")
    elif resp.status_code != 200:
        resp.failure(f"HTTP {resp.status_code}: {resp.text[:120]}")
    else:
        return True
    return False


class ChatUser(HttpUser):
    wait_time = between(0.5, 2.0)

    @task
    def chat(self) -> None:
        with self.client.post("/v1/chat/completions", json=_body(False), name="chat", catch_response=True) as resp:
            if _check(resp) and not resp.json()["choices"][0]["message"]["content"]:
                resp.failure("empty answer")

    @task
    def chat_stream(self) -> None:
        started = time.perf_counter()
        with self.client.post(
            "/v1/chat/completions", json=_body(True), name="chat (stream) headers", stream=True, catch_response=True
        ) as resp:
            if not _check(resp):
                return
            first = None
            for line in resp.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                delta = (json.loads(line[5:]).get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content") and first is None:
                    first = time.perf_counter() - started
            if first is None:
                resp.failure("stream had no content")
                return
            total = time.perf_counter() - started
            for name, seconds in (("TTFT", first), ("stream total", total)):
                self.environment.events.request.fire(
                    request_type="SSE",
                    name=name,
                    response_time=seconds * 1000,
                    response_length=0,
                    exception=None,
                    context={},
                )
