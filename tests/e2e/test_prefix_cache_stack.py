"""The prefix cache on `arena up` as a user starts it (one inference worker, SmolLM2 the
default model, its engine in a process of its own): a WebSocket conversation of five
turns with idle gaps between them, and then the same history sent whole to `/v1`, each
prefill after the first reusing exactly the previous turn's prompt and answer (all but
the end-of-turn token, which the engine stopped on and never fed), as the inference
worker's metrics count them."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import websockets

from tests.arena_up import ArenaUp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MODEL = "smollm2-135m"
TURNS = [
    "Hi! What is the capital of France?",
    "And of Italy?",
    "Which of the two cities is bigger?",
    "Name one famous museum in each.",
    "Thanks. Say goodbye in French.",
]
IDLE_S = 3.0


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    stack = ArenaUp(tmp_path_factory.mktemp("prefix"), ready_s=400)
    yield stack
    stack.stop()


def inference_counts(up) -> dict[str, float]:
    """The prefix cache's counters for the default model, summed over the inference processes."""
    groups = json.loads((up.state / "prometheus" / "targets.json").read_text())
    totals = {"hits": 0.0, "misses": 0.0, "reused_tokens": 0.0}
    for group in groups:
        if group["labels"]["role"] != "inference":
            continue
        text = httpx.get(f"http://{group['targets'][0]}/metrics", timeout=5).text
        for name in totals:
            found = re.search(rf'^arena_prefix_cache_{name}_total{{model="{MODEL}"}} (\S+)$', text, re.M)
            totals[name] += float(found.group(1)) if found else 0.0
    return totals


async def converse(url: str) -> list[dict]:
    """Each turn's `done` frame, with IDLE_S of silence on the socket before each later turn."""
    dones = []
    async with websockets.connect(f"{url.replace('http://', 'ws://')}/v1/ws?model={MODEL}") as sock:
        assert json.loads(await sock.recv())["type"] == "session"
        for i, content in enumerate(TURNS):
            if i:
                await asyncio.sleep(IDLE_S)
            await sock.send(json.dumps({"type": "turn", "content": content, "temperature": 0, "max_tokens": 24}))
            while (frame := json.loads(await asyncio.wait_for(sock.recv(), 120)))["type"] == "chunk":
                pass
            assert frame["type"] == "done", frame
            dones.append(frame)
    return dones


def test_each_turn_reuses_the_previous_turns_keys_and_values(up):
    before = inference_counts(up)
    dones = asyncio.run(converse(up.url))
    after = inference_counts(up)
    used = [d["usage"] for d in dones]
    assert all(d["text"] for d in dones), dones
    # Turn k+1's prompt starts with turn k's prompt and answer: all of it is reused but the
    # answer's last token (the end-of-turn token, or the last one allowed), never fed.
    expected = sum(u["prompt_tokens"] + u["completion_tokens"] - 1 for u in used[:-1])
    assert after["hits"] - before["hits"] == len(TURNS) - 1, (before, after)
    assert after["misses"] - before["misses"] == 1, (before, after)
    assert after["reused_tokens"] - before["reused_tokens"] == expected, (before, after, used)

    # The same history sent whole to /v1 (an OpenAI client's next turn) finds it too.
    messages = []
    for content, done in zip(TURNS, dones, strict=True):
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": done["text"]}]
    messages.append({"role": "user", "content": "One more: and in Spanish?"})
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16}
    answer = httpx.post(f"{up.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    last = inference_counts(up)
    assert last["hits"] - after["hits"] == 1
    assert (
        last["reused_tokens"] - after["reused_tokens"] == used[-1]["prompt_tokens"] + used[-1]["completion_tokens"] - 1
    )
