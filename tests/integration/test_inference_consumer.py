"""The inference consumer against a real nats-server, redis-server and stories260K."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial

import httpx
import nats
import pytest

from runtime.net import free_port
from tests.conftest import STORIES, stored_events
from tests.conftest import STORY_PROMPTS as PROMPTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CHAT = "/v1/chat/completions"


def ask(url, content, **kw):
    body = {"model": "stories-260k", "messages": [{"role": "user", "content": content}], **kw}
    return httpx.post(url + CHAT, json=body, timeout=60)


async def ask_many(url, prompts, **kw):
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(p):
            body = {"model": "stories-260k", "messages": [{"role": "user", "content": p}], **kw}
            return await client.post(url + CHAT, json=body)

        return await asyncio.gather(*(one(p) for p in prompts))


def metric(port, name):
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#")
    )


@pytest.mark.parametrize("engine", ["continuous", "static"])
def test_batches_form_under_concurrent_load_and_outputs_do_not_depend_on_them(stack_factory, engine):
    port = free_port()
    s = stack_factory(ARENA_METRICS_PORT=port, ARENA_MAX_WAIT_MS=20, ARENA_ENGINE=engine).start()
    params = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=48, deadline_s=90)
    alone = {p: ask(s.url, p, **params).json()["choices"][0]["message"]["content"] for p in PROMPTS[:2]}
    greedy_alone = ask(s.url, PROMPTS[2], temperature=0, max_tokens=48).json()["choices"][0]["message"]["content"]

    together = asyncio.run(ask_many(s.url, PROMPTS * 2, **params))
    assert all(r.status_code == 200 for r in together), [(r.status_code, r.text[:200]) for r in together]
    texts = [r.json()["choices"][0]["message"]["content"] for r in together]
    for p, t in zip(PROMPTS * 2, texts, strict=False):
        if p in alone:
            assert t == alone[p], "seeded sampling changed inside a batch"
    greedy_batch = asyncio.run(ask_many(s.url, [PROMPTS[2], *PROMPTS[3:]], temperature=0, max_tokens=48, deadline_s=90))
    assert greedy_batch[0].json()["choices"][0]["message"]["content"] == greedy_alone

    count = metric(port, "arena_batch_size_count")
    total = metric(port, "arena_batch_size_sum")
    assert count > 0 and total / count > 1.0, "no decode step ran more than one request"


def test_hopeless_deadline_is_refused_without_compute(stack_factory):
    """A deadline shorter than the pipeline's fixed overhead can never be met: 400
    deadline_too_short naming deadline_s (no 429: a retry would fail the same); the model
    never runs. (A request that still expires before a worker pulls it fails there with
    deadline_exceeded, without compute.)"""
    port = free_port()
    s = stack_factory(ARENA_METRICS_PORT=port).start()
    r = ask(s.url, "Once upon a time", deadline_s=0.001, max_tokens=16)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "deadline_too_short" and error["param"] == "deadline_s", error
    assert metric(port, "arena_tokens_generated_total") == 0


def _wait_for_chunks(nats_url, timeout=30.0):
    """Block until the stream holds some token events; returns their request ids."""

    async def go():
        nc = await nats.connect(nats_url)
        js = nc.jetstream()
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end:
                try:
                    info = await js.stream_info("ARENA", subjects_filter="arena.res.tokens.>")
                    if info.state.subjects:
                        return True
                except nats.errors.Error:  # the stream may not exist yet
                    pass
                await asyncio.sleep(0.05)
            return False
        finally:
            await nc.close()

    return asyncio.run(go())


def _stream_request(url, content, out, **kw):
    """Read an SSE stream into out[content] = text."""
    body = {"model": "stories-260k", "messages": [{"role": "user", "content": content}], "stream": True, **kw}
    text = ""
    with httpx.stream("POST", url + CHAT, json=body, timeout=90) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                d = json.loads(line[6:])
                if d.get("choices"):
                    text += d["choices"][0]["delta"].get("content") or ""
            if line.startswith("data: ") and '"error"' in line:
                out[content] = ("error", line)
                return
        out["rid:" + content] = r.headers["x-request-id"]
    out[content] = text


def test_kill_9_mid_generation_loses_and_duplicates_nothing(stack_factory):
    import threading

    s = stack_factory(ARENA_ACK_WAIT_S=3, ARENA_MAX_WAIT_MS=20)
    s.start(roles=("filter", "delivery", "gateway", "inference"))
    victim = s.stack.procs["inference"]
    prompts = PROMPTS[:4]
    out: dict = {}
    threads = [
        threading.Thread(
            target=_stream_request,
            args=(s.url, p, out),
            kwargs=dict(max_tokens=400, temperature=0.8, seed=7, deadline_s=90),
        )
        for p in prompts
    ]
    for t in threads:
        t.start()
    assert _wait_for_chunks(s.nats.url), "no tokens were generated"
    s.stack.spawn("inference", "inference-b")  # the survivor
    time.sleep(0.3)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    for t in threads:
        t.join(120)
    for p in prompts:
        assert isinstance(out.get(p), str), out.get(p)
        events = stored_events(s.nats.url, out["rid:" + p])
        terminals = [e for e in events if e.type in ("chat.completed", "chat.failed", "prompt.rejected")]
        assert [e.type for e in terminals] == ["chat.completed"]
        chunks = [e for e in events if e.type == "tokens.generated"]
        assert [c.seq for c in chunks] == list(range(len(chunks))), "gap or duplicate in the stream"
        assert "".join(c.text for c in chunks) == terminals[0].text
        assert out[p] == terminals[0].text, "the client saw other text than the completed answer"


def test_sigterm_drains_and_gives_back_unfinished_work(stack_factory):
    import threading

    s = stack_factory(ARENA_DRAIN_GRACE_S=0.5, ARENA_MAX_WAIT_MS=20)
    s.start(roles=("filter", "delivery", "gateway", "inference"))
    first = s.stack.procs["inference"]
    out: dict = {}
    threads = [
        threading.Thread(
            target=_stream_request, args=(s.url, p, out), kwargs=dict(max_tokens=400, temperature=0, deadline_s=90)
        )
        for p in PROMPTS[:3]
    ]
    for t in threads:
        t.start()
    assert _wait_for_chunks(s.nats.url)
    s.stack.spawn("inference", "inference-b")
    time.sleep(0.3)
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0, s.log("inference")[-3000:]
    for t in threads:
        t.join(120)
    for p in PROMPTS[:3]:
        assert isinstance(out.get(p), str) and out[p], out.get(p)
        terminals = [e for e in stored_events(s.nats.url, out["rid:" + p]) if e.type == "chat.completed"]
        assert len(terminals) == 1 and terminals[0].text == out[p]
    assert "given back" in s.log("inference")


def models_cmd(nats_url: str, *args: str) -> tuple[int, list[dict]]:
    """`arena models ...` against the stack's NATS: its exit code and every worker's answer
    (the JSON lines it prints; the last answer's `printed`: the whole output)."""
    r = subprocess.run(
        [sys.executable, "-m", "infra.cli", "models", *args, "--wait", "20"],
        env={**os.environ, "NATS_URL": nats_url},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    answers = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    return r.returncode, answers or [{"printed": r.stdout}]


def test_hot_swap_add_reload_remove_while_serving(stack_factory, tmp_path):
    s = stack_factory().start()
    models = partial(models_cmd, s.nats.url)
    rc, answers = models("add", "--name", "stories-b", "--path", str(STORIES))
    assert rc == 0 and "stories-b" in answers[0]["resident"]
    assert ask(s.url, "Once upon a time", model="stories-b", max_tokens=8).status_code == 200
    rc, answers = models("reload", "--name", "stories-b")
    assert rc == 0
    assert ask(s.url, "Once upon a time", model="stories-b", max_tokens=8).status_code == 200
    rc, answers = models("remove", "--name", "stories-b")
    assert rc == 0 and "stories-b" not in answers[0]["models"]
    rc, (answer,) = models("remove", "--name", "stories-260k")  # the default model: refused, still served
    assert rc == 1 and "is the default model (ARENA_DEFAULT_MODEL)" in answer["error"], answer
    assert "stories-260k" in answer["models"] and httpx.get(f"{s.url}/readyz").status_code == 200
    time.sleep(1.5)  # the gateway learns the fleet's models from heartbeats
    assert ask(s.url, "Once upon a time", model="stories-b", max_tokens=8).status_code == 404
    assert ask(s.url, "Once upon a time", max_tokens=8).status_code == 200


def test_a_failed_add_leaves_nothing_registered(stack_factory, tmp_path):
    """A model that cannot load is not served (it stayed in /v1/models, every request to it
    a 500); a path that is nowhere says so; an existing name points to reload; a relative
    path is the models directory's, as in the models config; a model added with
    quantized weights serves and shows them."""
    s = stack_factory().start()
    models = partial(models_cmd, s.nats.url)
    rc, (answer,) = models("add", "--name", "ghost", "--path", str(tmp_path / "nowhere"))
    assert rc == 1 and "no such directory" in answer["error"] and "ghost" not in answer["models"], answer
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "vocab_size": "many"}')
    rc, (answer,) = models("add", "--name", "broken", "--path", str(broken))
    assert rc == 1 and "broken" not in answer["models"], answer
    rc, (answer,) = models("add", "--name", "stories-260k", "--path", str(STORIES))
    assert rc == 1 and "arena models reload --name stories-260k" in answer["error"], answer
    # not in this cwd; served with int8 weights (quantize.py): it answers, and the list says so
    rc, (answer,) = models("add", "--name", "relative", "--path", STORIES.name, "--quantize", "int8")
    assert rc == 0 and "relative" in answer["resident"], answer
    time.sleep(1.5)  # the gateway learns the fleet's models from heartbeats
    listed = {m["id"] for m in httpx.get(f"{s.url}/v1/models").json()["data"]}
    assert listed == {"stories-260k", "relative"}
    assert ask(s.url, "Once upon a time", model="broken", max_tokens=8).status_code == 404
    assert ask(s.url, "Once upon a time", model="relative", max_tokens=8).status_code == 200
    # What each model is and costs, as `arena models list` shows it.
    rc, (answer,) = models("list", "--json")
    details = {d["name"]: d for d in answer["details"]}
    assert rc == 0 and details["relative"]["source"] == str(STORIES) and details["relative"]["quantize"] == "int8"
    stories = details["stories-260k"]
    assert (stories["resident"], stories["dtype"], stories["context"]) == (True, "float32", 512), stories
    assert stories["chat_template"] is False and 250_000 < stories["parameters"] < 300_000
    assert 0 <= stories["resident_bytes"] - 4 * stories["parameters"] < 1024  # float32, and its buffers
    rc, (table,) = models("list")
    assert rc == 0 and "CHAT TEMPLATE" in table["printed"] and "no (plain text)" in table["printed"], table
    assert "float32 + int8" in table["printed"] and stories["quantize"] is None, table
