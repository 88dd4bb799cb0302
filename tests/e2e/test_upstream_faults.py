"""An upstream that fails in each way a network and a server fail, through the gateway:
a real `llama-server` (SmolLM2) behind the fault-injecting proxy of tests/upstream_proxy.py,
served by `arena up --models-config` as two `backend: upstream` models, one whose entry
says its upstream continues a chat's final assistant message (`continue_chat`) and one
that does not. Each fault's outcome is asserted as the client sees it and as the event
log stores it: a continuation or a clear error in the API's error shape, the stored chunks
exactly what the client was sent (nothing lost, nothing twice), the circuit opening and
closing where it should, `arena audit` clean. (The circuit opened by refused connections,
two 429s waited out and a completions stream continued are tests/e2e/test_upstream_circuit.py's.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.arena_up import ArenaUp, arena
from tests.conftest import stored_events
from tests.e2e.test_upstream import KEY, upstream  # noqa: F401 - the fixture: a real llama-server
from tests.streams import Stream, stream_one
from tests.upstream_proxy import FaultyProxy, proxied_stack
from tests.waiting import until, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CONTINUES = "smollm2-continues"  # continue_chat: true
PLAIN = "smollm2-plain"
READ_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def faulty(upstream: str, tmp_path_factory) -> Iterator[tuple[ArenaUp, FaultyProxy]]:  # noqa: F811
    entry = f"base_url: '{{url}}', model: smollm2, api_key_env: TEAM_KEY, read_timeout_s: {READ_TIMEOUT_S}"
    entries = [
        f"{{name: {CONTINUES}, backend: upstream, upstream: {{{entry}, continue_chat: true}}}}",
        f"{{name: {PLAIN}, backend: upstream, upstream: {{{entry}}}}}",
    ]
    with proxied_stack(upstream, tmp_path_factory.mktemp("faults"), entries, KEY) as stack:
        yield stack


@pytest.fixture(autouse=True)
def passing(faulty) -> None:
    """Each test starts with the proxy passing everything: a failed test's faults not left queued."""
    proxy = faulty[1]
    proxy.faults.clear()
    proxy.pace_s, proxy.retry_after, proxy.refusing = 0.0, "1", False


def chat(model: str, content: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


def post(up: ArenaUp, body: dict, path: str = "/v1/chat/completions", **kw) -> httpx.Response:
    return httpx.post(up.url + path, json=body, timeout=90, **kw)


def stored(up: ArenaUp, request_id: str) -> tuple[str, Any]:
    """The text of a request's stored chunks, checked to be seq 0, 1, ... once each, and its
    one terminal event."""
    events = stored_events(up.nats_url, request_id)
    chunks = [e for e in events if e.type == "tokens.generated"]
    assert [c.seq for c in chunks] == list(range(len(chunks))), [c.seq for c in chunks]
    [terminal] = [e for e in events if e.type in ("chat.completed", "chat.failed")]
    return "".join(c.text for c in chunks), terminal


def worker_metric(up: ArenaUp, name: str, model: str) -> float:
    """One of the inference worker's series for ``model`` (0 where it has none yet)."""
    targets = json.loads((up.state / "prometheus" / "targets.json").read_text())
    [port] = [t["targets"][0].rsplit(":", 1)[1] for t in targets if t["labels"]["process"] == "inference-0"]
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def audit_clean(up: ArenaUp) -> None:
    audit = arena("audit", "--since", "1h", "--state-dir", str(up.state), "--json", env=up.env)
    assert audit.returncode == 0 and json.loads(audit.stdout)["ok"], audit.stdout


def test_connections_refused_before_the_first_token_are_tried_again(faulty):
    up, proxy = faulty
    body = chat(CONTINUES, "Name a fruit.", max_tokens=8)
    whole = post(up, body).json()["choices"][0]["message"]["content"]
    failures = worker_metric(up, "arena_upstream_failures_total", CONTINUES)
    proxy.refusing = True  # its port closed: the kernel refuses each connection
    answer: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answer.append(post(up, body)))
    sender.start()
    try:  # refused, then let through: 1.85 s of backoffs (0.1, 0.25, 0.5, 1 s) before a fifth refusal
        wait_for(
            lambda: worker_metric(up, "arena_upstream_failures_total", CONTINUES) > failures,
            30,
            "a refused connection",
            every=0.05,
        )
    finally:
        proxy.refusing = False
    sender.join(60)
    [r] = answer
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == whole, r.text
    assert worker_metric(up, "arena_upstream_circuit_open", CONTINUES) == 0  # fewer than 5 in a row
    text, terminal = stored(up, r.headers["x-request-id"])
    assert terminal.type == "chat.completed" and text == whole
    audit_clean(up)


def test_a_stall_before_the_first_byte_is_tried_again_after_the_read_timeout(faulty):
    up, proxy = faulty
    mark = uuid.uuid4().hex[:6]
    body = chat(CONTINUES, f"Name a colour ({mark}).", max_tokens=8)
    proxy.fail_next("stall")
    t0 = time.monotonic()
    r = post(up, body)
    took = time.monotonic() - t0
    assert r.status_code == 200 and not proxy.faults, r.text
    assert READ_TIMEOUT_S <= took < READ_TIMEOUT_S + 8, took
    # The stalled try never reached the upstream; the second was its only call.
    assert len(proxy.calls_with(mark)) == 1
    assert r.json()["choices"][0]["message"]["content"] == post(up, body).json()["choices"][0]["message"]["content"]
    text, terminal = stored(up, r.headers["x-request-id"])
    assert terminal.type == "chat.completed" and text == r.json()["choices"][0]["message"]["content"]
    audit_clean(up)


def test_a_retry_after_too_long_to_wait_is_a_clear_429_and_no_failure(faulty):
    up, proxy = faulty
    busy = worker_metric(up, "arena_upstream_busy_total", CONTINUES)
    proxy.retry_after = "120"  # past MAX_RETRY_AFTER_S (30 s) and the request's deadline
    proxy.fail_next("busy")
    t0 = time.monotonic()
    r = post(up, chat(CONTINUES, "Hi", max_tokens=4))
    assert time.monotonic() - t0 < 10
    error = r.json()["error"]
    assert r.status_code == 429 and error["code"] == "overloaded" and "busy" in error["message"], r.text
    assert worker_metric(up, "arena_upstream_busy_total", CONTINUES) == busy + 1
    assert worker_metric(up, "arena_upstream_circuit_open", CONTINUES) == 0  # busy is no failure
    assert post(up, chat(CONTINUES, "Hi", max_tokens=4)).status_code == 200
    audit_clean(up)


def test_500s_are_clear_errors_and_five_in_a_row_open_the_circuit_until_a_probe(faulty):
    up, proxy = faulty
    proxy.fail_next(*["error"] * 5)
    for _ in range(5):  # a 500 is not tried again: the upstream answered, and failed
        r = post(up, chat(CONTINUES, "Hi", max_tokens=4))
        error = r.json()["error"]
        assert r.status_code == 500 and "upstream of smollm2-continues failed" in error["message"], r.text
        assert "answered 500" in error["message"] and KEY not in r.text
    assert not proxy.faults
    assert worker_metric(up, "arena_upstream_circuit_open", CONTINUES) == 1
    refused = post(up, chat(CONTINUES, "Hi", max_tokens=4))  # at once, by the worker or the gateway
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_unavailable", refused.text
    assert post(up, chat(PLAIN, "Hi", max_tokens=4)).status_code == 200  # its circuit is its own
    # The worker's half-open probe (its /models, let through) closes it after 5 s.
    wait_for(lambda: worker_metric(up, "arena_upstream_circuit_open", CONTINUES) == 0, 30, "the circuit closed")
    wait_for(lambda: post(up, chat(CONTINUES, "Hi", max_tokens=4)).status_code == 200, 30, "served again")
    audit_clean(up)


def test_a_chat_stream_cut_mid_answer_is_continued_or_ends_with_a_clear_error(faulty):
    up, proxy = faulty
    mark = uuid.uuid4().hex[:6]
    body = chat(CONTINUES, f"Tell me about the sea ({mark}).", max_tokens=24, ignore_eos=True)

    async def streamed(body: dict) -> Stream:
        async with httpx.AsyncClient(timeout=90) as client:
            return await stream_one(client, up.url, body)

    proxy.fail_next("drop")  # 3 events passed on, then the connection cut
    continued = asyncio.run(streamed(body))
    assert continued.status == 200 and continued.done and continued.error is None, continued
    calls = proxy.calls_with(mark)
    assert len(calls) == 2 and "continue_final_message" not in calls[0].body
    # The second call continues the answer the first had given: a final assistant message.
    again = calls[1].body
    [*_, before] = again["messages"]
    assert before["role"] == "assistant" and before["content"] and again["continue_final_message"] is True
    assert continued.text.startswith(before["content"]) and len(continued.text) > len(before["content"])
    # Not echoed: llama-server sends the message's text again unless it is told continue_final_message.
    assert not continued.text.removeprefix(before["content"]).startswith(before["content"]), continued.text
    text, terminal = stored(up, continued.request_id)
    assert terminal.type == "chat.completed" and text == terminal.text == continued.text

    proxy.fail_next("drop")  # an upstream that cannot continue a chat: a clear error
    ended = asyncio.run(streamed({**body, "model": PLAIN}))
    assert ended.status == 200 and ended.error is not None and "broke off mid-answer" in ended.error["message"]
    assert len(proxy.calls_with(mark)) == 3  # not tried again
    text, terminal = stored(up, ended.request_id)
    assert terminal.type == "chat.failed" and text == ended.text and ended.text  # what it sent, once
    audit_clean(up)


def test_a_malformed_event_ends_the_answer_with_a_clear_error(faulty):
    up, proxy = faulty
    mark = uuid.uuid4().hex[:6]
    failures = worker_metric(up, "arena_upstream_failures_total", CONTINUES)
    proxy.fail_next("malformed")  # 3 events, then `data: {"choices": ...` cut short
    r = post(up, chat(CONTINUES, f"Hi ({mark})", max_tokens=16, ignore_eos=True))
    error = r.json()["error"]
    assert r.status_code == 500 and "sent what cannot be read" in error["message"], r.text
    assert len(proxy.calls_with(mark)) == 1  # garbage is not asked for again
    assert worker_metric(up, "arena_upstream_failures_total", CONTINUES) == failures + 1  # a failure for the circuit
    text, terminal = stored(up, r.headers["x-request-id"])
    assert terminal.type == "chat.failed" and '"x' not in text
    audit_clean(up)


def test_an_idempotent_retry_never_calls_the_upstream_twice(faulty):
    up, proxy = faulty
    mark = uuid.uuid4().hex[:6]
    body = chat(CONTINUES, f"Say hello to {mark}.", max_tokens=24)
    headers = {"Idempotency-Key": f"retry-{mark}"}
    proxy.pace_s = 0.1  # the first still streaming when its retry comes

    async def twice() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=up.url, timeout=90) as client:
            first = asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=headers))
            await until(lambda: proxy.calls_with(mark), 30, "the first at the upstream")
            second = await client.post("/v1/chat/completions", json=body, headers=headers)
            return [await first, second]

    first, second = asyncio.run(twice())
    proxy.pace_s = 0.0
    third = post(up, body, headers=headers)  # after the first ended
    answers = [r.json() for r in (first, second, third)]
    assert all(r.status_code == 200 for r in (first, second, third)), answers
    assert len({a["x_arena"]["request_id"] for a in answers}) == 1
    assert len({a["choices"][0]["message"]["content"] for a in answers}) == 1
    assert len(proxy.calls_with(mark)) == 1
    audit_clean(up)


def test_kill_9_of_the_worker_mid_answer_continues_from_the_stored_chunks(faulty):
    """Last: the stack's worker is the promoted spare after it."""
    up, proxy = faulty
    mark = uuid.uuid4().hex[:6]
    common = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "deadline_s": 90}
    requests = [
        ("/v1/chat/completions", chat(CONTINUES, f"Tell me a story ({mark}).", **common)),
        ("/v1/chat/completions", chat(PLAIN, f"Tell me a story ({mark}).", **common)),
        ("/v1/completions", {"model": CONTINUES, "prompt": f"A story ({mark}): Once upon a time", **common}),
    ]
    [victim] = up.inference_pids()
    proxy.pace_s = 0.2  # 40 tokens: 8 s an answer

    async def run() -> list[Stream]:
        async with httpx.AsyncClient(timeout=120) as client:
            seen = [Stream() for _ in requests]
            tasks = [
                asyncio.create_task(stream_one(client, up.url, body, out=s, path=path))
                for (path, body), s in zip(requests, seen, strict=True)
            ]
            await until(lambda: all(len(s.chunk_times) >= 3 for s in seen), 60, lambda: seen)
            assert not any(s.done for s in seen), "an answer ended before the kill"
            os.kill(victim, signal.SIGKILL)
            await asyncio.gather(*tasks)
            return seen

    t0 = time.monotonic()
    cont, plain, text = asyncio.run(run())
    print(f"\n[kill -9, upstream] 3 answers ended {time.monotonic() - t0:.1f} s after they were sent")
    assert victim not in up.inference_pids()

    # chat, continue_chat: the stored chunks sent on as a final assistant message, the
    # answer whole and once.
    assert cont.status == 200 and cont.done and cont.error is None, cont
    [again] = [c.body for c in proxy.calls_with(mark) if c.body.get("continue_final_message")]
    prefix = again["messages"][-1]["content"]
    assert prefix and cont.text.startswith(prefix) and len(cont.text) > len(prefix)
    assert not cont.text.removeprefix(prefix).startswith(prefix), cont.text  # not echoed
    stored_text, terminal = stored(up, cont.request_id)
    assert terminal.type == "chat.completed" and stored_text == terminal.text == cont.text
    assert terminal.usage.completion_tokens <= 40

    # chat, no continue_chat: a clear error after what was sent, nothing more.
    error = plain.error
    assert plain.status == 200 and error is not None and "cannot continue a chat answer" in error["message"], plain
    assert error["code"] == "internal_error"  # not the client's 400
    stored_text, terminal = stored(up, plain.request_id)
    assert terminal.type == "chat.failed" and stored_text == plain.text and plain.text

    # completions: continued from the prompt and the stored text.
    assert text.status == 200 and text.done and text.error is None, text
    prompt = requests[2][1]["prompt"]
    [again] = [
        c.body for c in proxy.calls_with(mark) if c.path.endswith("/v1/completions") and c.body["prompt"] != prompt
    ]
    assert again["prompt"].startswith(prompt)
    prefix = again["prompt"].removeprefix(prompt)
    assert prefix and text.text.startswith(prefix) and len(text.text) > len(prefix)
    stored_text, terminal = stored(up, text.request_id)
    assert terminal.type == "chat.completed" and stored_text == terminal.text == text.text
    audit_clean(up)
