"""The inference service in-process against a real nats-server: a poison request ends alone,
with exactly one terminal event, no job is ever held, and a request taken over from a dead
worker continues where that worker was (stories260K on the CPU)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial

import pytest
from prometheus_client import REGISTRY

from consumers.inference.engine import sequences as engine_module
from consumers.inference.engine.batch import BatchEngine
from consumers.inference.model_loading import ModelSpec
from consumers.inference.pool import ModelPool
from consumers.inference.settings import InferenceSettings
from consumers.inference.worker.worker import InferenceService
from events import decode, subjects, topology
from events.models import ChatMessage, ChatRequested, FilterReport, PromptAccepted, SamplingParams, TokensGenerated
from infra.audit import audit
from runtime import jetstream
from runtime.stream import read_events
from tests.conftest import STORIES
from tests.conftest import STORY_PROMPTS as PROMPTS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = "stories-260k"
POISON_SEED = 4242


def healthy_params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=24)
    return SamplingParams(temperature=0, max_tokens=24, seed=100 + i)


@dataclass
class Worker:
    js: object
    service: InferenceService
    sub: object


async def start_worker(nats_url: str, **settings_kw) -> tuple[Worker, object]:
    """An inference service on stories260K pulling from the inference durable; (worker, connection).
    Its engine steps on a thread of this process unless ``engine_process=True``: these tests
    patch the engine's functions, which a child process would not see."""
    settings_kw.setdefault("engine_process", False)
    settings = InferenceSettings(nats_url=nats_url, max_batch_size=16, chunk_tokens=4, **settings_kw)
    nc = await jetstream.connect(settings.nats_url, "test-inference-service")
    js = nc.jetstream()
    await jetstream.ensure_topology(js, **settings.topology())
    pool = ModelPool([ModelSpec(name=MODEL, path=str(STORIES))], 2**30)
    service = InferenceService(
        settings,
        pool,
        partial(jetstream.publish, js),
        watchdog_margin_s=0.5,
        watchdog_period_s=0.1,
        recorded=lambda rid: read_events(js, subjects.output_filter(rid), timeout=2.0),
    )
    service.start()
    sub = await js.pull_subscribe(subjects.INFERENCE_SUBJECT, durable=topology.INFERENCE.name)
    return Worker(js, service, sub), nc


@pytest.fixture
async def worker(nats_server):
    w, nc = await start_worker(nats_server.url)
    yield w
    await w.service.stop()
    await nc.close()


async def request(
    js, rid: str, prompt: str, params: SamplingParams, deadline_s: float = 60.0, model: str = MODEL
) -> None:
    """What the gateway and the filter publish for one request."""
    now = time.time()
    common = dict(
        request_id=rid,
        conv_id=rid,
        model=model,
        messages=(ChatMessage(role="user", content=prompt),),
        params=params,
        deadline_at=now + deadline_s,
        received_at=now,
    )
    await jetstream.publish(js, ChatRequested(**common))
    await jetstream.publish(js, PromptAccepted(**common, filter=FilterReport(action="pass")))


async def serve(w: Worker, n: int, timeout: float = 90.0) -> dict:
    """Pull and submit ``n`` requests, wait until the worker holds none; their terminal events."""
    got = 0
    while got < n:
        for msg in await w.sub.fetch(n - got, timeout=10):
            await w.service.submit(decode(msg.data), msg)
            got += 1
    end = time.monotonic() + timeout
    while w.service.jobs and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert not w.service.jobs, f"jobs still held: {list(w.service.jobs)}"
    await w.service.outbox.join()
    info = await w.js.consumer_info(subjects.STREAM, topology.INFERENCE.name)
    assert info.num_ack_pending == 0, "a message was neither acked nor termed"
    events = await read_events(w.js, "arena.>")
    report = audit(events)
    assert report["ok"] and not report["in_flight"], report
    return {e.request_id: e for e in events if e.type in ("chat.completed", "chat.failed")}


async def test_poison_in_a_batch_of_nine_fails_alone_and_neighbours_keep_their_text(worker, monkeypatch):
    for i, p in enumerate(PROMPTS):
        await request(worker.js, f"alone{i}", p, healthy_params(i))
    before = await serve(worker, len(PROMPTS))

    real = engine_module.pick_tokens

    def pick(logits, params, uniforms, generated):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("simulated sampler failure for one request")
        return real(logits, params, uniforms, generated)

    monkeypatch.setattr(engine_module, "pick_tokens", pick)
    for i, p in enumerate(PROMPTS[:4]):
        await request(worker.js, f"with{i}", p, healthy_params(i))
    await request(worker.js, "poison", "Once upon a time", SamplingParams(temperature=0.8, seed=POISON_SEED))
    for i, p in enumerate(PROMPTS[4:], start=4):
        await request(worker.js, f"with{i}", p, healthy_params(i))
    after = await serve(worker, len(PROMPTS) + 1)

    poison = after.pop("poison")
    assert (poison.type, poison.code) == ("chat.failed", "internal_error")
    assert {rid: e.type for rid, e in after.items() if rid.startswith("with")} == {
        f"with{i}": "chat.completed" for i in range(len(PROMPTS))
    }
    assert [after[f"with{i}"].text for i in range(len(PROMPTS))] == [
        before[f"alone{i}"].text for i in range(len(PROMPTS))
    ]


async def test_unservable_sampling_parameters_fail_at_intake(worker):
    # The event contract allows 1e-300 (0 <= t <= 2); the worker refuses it by name.
    await request(worker.js, "ok0", PROMPTS[0], healthy_params(0))
    await request(worker.js, "tiny", PROMPTS[1], SamplingParams(temperature=1e-300, seed=1))
    await request(worker.js, "ok1", PROMPTS[2], healthy_params(1))
    done = await serve(worker, 3)
    assert (done["tiny"].type, done["tiny"].code) == ("chat.failed", "internal_error")
    assert "temperature" in done["tiny"].message
    assert done["ok0"].type == done["ok1"].type == "chat.completed"


async def test_watchdog_fails_a_job_the_engine_lost(worker, monkeypatch):
    real_add = BatchEngine.add

    def losing_add(self, req):  # the engine never sees "lost"; nothing would ever end it
        if req.request_id != "lost":
            real_add(self, req)

    monkeypatch.setattr(BatchEngine, "add", losing_add)
    sample = partial(REGISTRY.get_sample_value, "arena_watchdog_reaped_total", {"model": MODEL})
    reaped = sample() or 0.0
    await request(worker.js, "lost", PROMPTS[0], healthy_params(0), deadline_s=1.0)
    await request(worker.js, "kept", PROMPTS[1], healthy_params(1), deadline_s=60)
    done = await serve(worker, 2, timeout=20)
    assert (done["lost"].type, done["lost"].code) == ("chat.failed", "deadline_exceeded")
    assert done["kept"].type == "chat.completed"
    assert sample() == reaped + 1
    info = await worker.js.consumer_info(subjects.STREAM, topology.INFERENCE.name)
    assert info.num_pending == 0 and info.num_redelivered == 0  # termed, not given back


async def _die_after(w: Worker, rid: str, chunks: list[TokensGenerated], terminal=None) -> None:
    """What a worker that died left behind: `chunks` (and maybe the terminal) of `rid` in
    the stream, its message unacked; then the hand-on (a nak) gives the message back."""
    [msg] = await w.sub.fetch(1, timeout=10)
    for chunk in chunks:
        await jetstream.publish(w.js, chunk.model_copy(update={"request_id": rid, "conv_id": rid}))
    if terminal is not None:
        await jetstream.publish(w.js, terminal.model_copy(update={"request_id": rid, "conv_id": rid}))
    await msg.nak()


async def test_a_taken_over_request_continues_where_the_dead_worker_was(worker):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=31, max_tokens=40)
    await request(worker.js, "whole", PROMPTS[2], params)
    whole = (await serve(worker, 1))["whole"]
    reference = [
        e for e in await read_events(worker.js, subjects.output_filter("whole")) if e.type == "tokens.generated"
    ]
    resumed = partial(REGISTRY.get_sample_value, "arena_resumed_tokens_total")
    before = resumed() or 0.0

    await request(worker.js, "taken", PROMPTS[2], params)
    await _die_after(worker, "taken", reference[:3])
    done = (await serve(worker, 1))["taken"]

    chunks = [e for e in await read_events(worker.js, subjects.output_filter("taken")) if e.type == "tokens.generated"]
    assert [(c.seq, c.text) for c in chunks] == [(c.seq, c.text) for c in reference]
    assert done.type == "chat.completed" and done.text == whole.text and done.chunks == whole.chunks
    assert done.usage.completion_tokens == whole.usage.completion_tokens
    assert resumed() == before + sum(len(c.token_ids) for c in reference[:3])  # not generated again


async def test_a_taken_over_request_that_had_ended_is_only_acked(worker):
    await request(worker.js, "first", PROMPTS[3], healthy_params(2))
    first = (await serve(worker, 1))["first"]
    output = await read_events(worker.js, subjects.output_filter("first"))
    await request(worker.js, "ended", PROMPTS[3], healthy_params(2))
    await _die_after(worker, "ended", [e for e in output if e.type == "tokens.generated"], terminal=first)
    done = await serve(worker, 1)
    assert done["ended"].text == first.text
    events = await read_events(worker.js, subjects.output_filter("ended"))
    assert sum(e.terminal for e in events) == 1  # nothing published again
