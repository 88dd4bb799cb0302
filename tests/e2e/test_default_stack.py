"""What a newcomer gets from `scripts/install.sh && arena up` with no flags: a real chat
model (SmolLM2-135M-Instruct, from the GGUF the install ships) as the default model,
answering the README's first request right, the openai SDK streaming the same model, and
a private arena that battles two different sets of weights (SmolLM2 and stories-260k)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from openai import OpenAI

from tests.arena_up import ArenaUp
from tests.conftest import ask

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

BASES = {"smollm2-135m": "smollm2-135m", "smollm2-135m-brief": "smollm2-135m", "stories-260k": "stories-260k"}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    stack = ArenaUp(tmp_path_factory.mktemp("default"), ready_s=400)  # a first start converts the GGUF
    yield stack
    stack.stop()


def test_the_readmes_first_request_is_answered_by_a_real_chat_model(up):
    body = ask(up.url, "What is the capital of France?")
    assert body["model"] == "smollm2-135m" and "Paris" in body["choices"][0]["message"]["content"], body
    assert {m["id"] for m in httpx.get(f"{up.url}/v1/models").json()["data"]} == set(BASES)

    client = OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model="smollm2-135m",
            temperature=0,
            max_tokens=32,
            stream=True,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        if chunk.choices
    )
    assert streamed == body["choices"][0]["message"]["content"]


def test_the_default_arena_battles_two_different_sets_of_weights(up):
    seen: set[tuple[str, str]] = set()
    with httpx.Client(base_url=up.url, timeout=60) as client:
        for _ in range(12):  # pairs are drawn: keep battling until two different bases met
            bid = client.post("/arena/battles").json()["battle_id"]
            frames = []
            turn = {"prompt": "Name a colour.", "max_tokens": 16}
            with client.stream("POST", f"/arena/battles/{bid}/turns", json=turn) as t:
                assert t.status_code == 200
                frames = [json.loads(line[6:]) for line in t.iter_lines() if line.startswith("data: {")]
            assert {f.get("side") for f in frames if f.get("side")} == {"a", "b"}, frames[-3:]
            voted = client.post(f"/arena/battles/{bid}/vote", json={"choice": "tie"})
            assert voted.status_code == 200, voted.text
            pair = (voted.json()["model_a"], voted.json()["model_b"])
            seen.add(pair)
            if BASES[pair[0]] != BASES[pair[1]]:
                break
    assert any(BASES[a] != BASES[b] for a, b in seen), seen


def test_more_tokens_than_the_model_makes_in_the_deadline_is_a_400_up_front(up):
    """SmolLM2 on a CPU makes a token every few ms at best: 4,000 tokens cannot come in
    the default 15 s however idle the stack. Once a worker measured its speed alone, the
    request is refused before anything runs, streamed or not: 400 deadline_too_short
    naming max_tokens and the most that fits (no 429: a retry would fail the same), where
    it used to be admitted and cut at its deadline with a 504."""
    ask(up.url, "Count to ten.", max_tokens=24, ignore_eos=True)  # the worker's steps alone, measured
    time.sleep(2.5)  # in a heartbeat
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 4000}
    for stream in (False, True):
        r = httpx.post(f"{up.url}/v1/chat/completions", json=body | {"stream": stream}, timeout=30)
        error = r.json()["error"]
        assert (r.status_code, error["code"], error["param"]) == (400, "deadline_too_short", "max_tokens"), r.text
        fits = int(re.search(r"ask for at most (\d+) tokens", error["message"]).group(1))
        assert 0 < fits < 4000 and "retry-after" not in r.headers
    with_time = httpx.post(f"{up.url}/v1/chat/completions", json=body | {"max_tokens": 8, "deadline_s": 15}, timeout=30)
    assert with_time.status_code == 200, with_time.text
