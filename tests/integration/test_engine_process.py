"""The engine in a process of its own (`ARENA_ENGINE_PROCESS`, the default), against a real
nats-server and stories260K: the same tokens as the engine thread, forked from the fork
server and stepping the pool's weights from shared memory, a killed engine process's
requests are continued by the next one, it never outlives a consumer killed with -9, and
a model with no room in /dev/shm runs on a thread, a model of more tensors than a child can be
handed descriptors for (a 32-layer Llama) shares them as one buffer. And, for either runner: an evicted
model's engine is stopped with it."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from prometheus_client import REGISTRY
from transformers import LlamaConfig, LlamaForCausalLM

from consumers.inference.config import EngineConfig
from consumers.inference.engine import prepack
from consumers.inference.engine.batch import GenRequest
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.errors import RetryableError
from consumers.inference.metrics import LoadCollector
from consumers.inference.model_loading import ModelSpec, load_model, weights_nbytes
from consumers.inference.runners import factory as factory_module
from consumers.inference.runners import process as engine_process
from consumers.inference.runners.thread import PROFILE_PREFIX, EngineRunner
from events import decode
from tests.conftest import STORIES
from tests.conftest import STORY_PROMPTS as PROMPTS
from tests.integration.test_poison_service import MODEL, Worker, healthy_params, request, serve, start_worker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


async def start(nats_server, engine_process: bool) -> tuple[Worker, object]:
    return await start_worker(nats_server.url, engine_process=engine_process, torch_threads=1)


async def stop_worker(worker: Worker, nc) -> None:
    await worker.service.stop()
    await nc.close()


def runner_of(worker: Worker):
    (runner,) = worker.service.runners.values()
    return runner


async def test_the_engine_process_gives_the_threads_tokens(nats_server):
    texts = {}
    for mode in (False, True):
        worker, nc = await start(nats_server, engine_process=mode)
        try:
            for i, p in enumerate(PROMPTS):
                await request(worker.js, f"{mode}-{i}", p, healthy_params(i))
            steps = REGISTRY.get_sample_value("arena_engine_steps_total", {"model": MODEL}) or 0.0
            done = await serve(worker, len(PROMPTS))
            if mode:
                runner = runner_of(worker)
                assert runner.pid != os.getpid(), "the engine did not run in a child process"
                # Forked from the fork server (torch imported once), stepping the pool's own
                # weights from shared memory rather than a copy of its own.
                assert "multiprocessing.forkserver" in " ".join(psutil.Process(runner.pid).parent().cmdline())
                assert all(p.is_shared() for p in runner.loaded.model.parameters())
            # The steps count in the worker's metrics either way (those of a child come up the pipe).
            assert (REGISTRY.get_sample_value("arena_engine_steps_total", {"model": MODEL}) or 0.0) > steps + 20
        finally:
            await stop_worker(worker, nc)
        assert all(e.type == "chat.completed" for e in done.values()), done
        texts[mode] = [done[f"{mode}-{i}"].text for i in range(len(PROMPTS))]
    assert texts[True] == texts[False]  # greedy and seeded sampling alike


def random_llama(path, text_only: bool = False, **shape):
    """A random Llama of ``shape`` with stories260K's tokenizer, saved at ``path``;
    ``text_only``: no byte-fallback token (ids < 259) wins a greedy step, so answers are text."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, max_position_embeddings=256, **shape)
    model = LlamaForCausalLM(config)
    if text_only:
        with torch.no_grad():
            model.get_input_embeddings().weight[:259] = 0
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        shutil.copy(STORIES / name, path / name)
    return path


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory):
    """A random 32-layer Llama: 291 tensors, past the ~250 file descriptors
    multiprocessing hands a child at once (SmolLM2-135M has 272)."""
    return random_llama(
        tmp_path_factory.mktemp("deep"),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )


def shared_weights_maps(pid: int) -> list:
    """The child's shared mappings of torch's shared-memory files (the weights it steps)."""
    return [m for m in psutil.Process(pid).memory_maps(grouped=False) if "/torch_" in m.path and "s" in m.perms]


async def test_a_model_of_more_tensors_than_descriptors_a_child_takes_serves_from_one_buffer(nats_server, deep_model):
    texts = {}
    for mode in (False, True):
        worker, nc = await start(nats_server, engine_process=mode)
        try:
            await worker.service.pool.add(ModelSpec(name="deep", path=str(deep_model)))
            for i, p in enumerate(PROMPTS):
                await request(worker.js, f"{mode}-{i}", p, healthy_params(i), model="deep")
            done = await serve(worker, len(PROMPTS))
            if mode:
                runner = runner_of(worker)
                model = runner.loaded.model
                assert len(model.state_dict()) > 250
                assert runner.pid != os.getpid() and runner.ready.is_set()
                # One float32 buffer in shared memory, the pool's own: the child maps it,
                # every parameter a view of it, rather than a copy of its own.
                assert all(p.is_shared() for p in model.parameters())
                assert len(engine_process.storages(model)) == 1
                (mapped,) = shared_weights_maps(runner.pid)
                assert mapped.size >= runner.loaded.nbytes
        finally:
            await stop_worker(worker, nc)
        assert all(e.type == "chat.completed" for e in done.values()), done
        texts[mode] = [done[f"{mode}-{i}"].text for i in range(len(PROMPTS))]
    assert texts[True] == texts[False]


async def test_a_packed_bfloat16_model_serves_the_same_tokens_from_an_engine_process(nats_server, deep_model):
    """bfloat16 linear layers packed in oneDNN's layout by the engine that steps them
    (prepack.py, where the CPU computes bfloat16 natively): the engine process packs its
    copy of the pool's shared weights (the pool's stay row-major and shared), the thread
    engine the pool's own; both answer alike. Each request is served alone: bfloat16 rounds
    differently with a batch's row count (the known defect test_chat_parity keeps as an
    xfail), and the rows a request shares a step with depend on when each arrives."""
    texts = {}
    for mode in (False, True):
        worker, nc = await start(nats_server, engine_process=mode)
        try:
            await worker.service.pool.add(ModelSpec(name="deep", path=str(deep_model), dtype="bfloat16"))
            done = {}
            for i, p in enumerate(PROMPTS):
                await request(worker.js, f"{mode}-{i}", p, healthy_params(i), model="deep")
                done |= await serve(worker, 1)
            model = runner_of(worker).loaded.model
            linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, prepack.PackedLinear))]
            packed = prepack.supported(model, "cpu") and not mode
            assert all(isinstance(m, prepack.PackedLinear) == packed for m in linears) and len(linears) == 32 * 7 + 1
            if mode:
                assert all(t.is_shared() for t in model.parameters())
        finally:
            await stop_worker(worker, nc)
        assert all(e.type == "chat.completed" for e in done.values()), done
        texts[mode] = [done[f"{mode}-{i}"].text for i in range(len(PROMPTS))]
    assert texts[True] == texts[False]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A random Llama of 26M weights, past prepack.MIN_PARAMS: `dtype: auto` packs its
    linear layers (bfloat16 or float16, by the CPU)."""
    return random_llama(
        tmp_path_factory.mktemp("wide"),
        text_only=True,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )


async def until_released(runner, layers: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while len(runner._released) != layers and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert len(runner._released) == layers, runner._released


def resident_shared_bytes(pid: int) -> int:
    """What of torch's shared-memory files (the pool's weights) is in memory, as ``pid`` maps them."""
    return sum(m.rss for m in shared_weights_maps(pid))


async def test_the_pools_copy_of_what_an_engine_process_packed_is_given_back_and_written_back_for_the_next(
    nats_server, wide_model
):
    """Packed by the engine process (prepack.py), the pool's row-major linear weights are
    read by no one: the worker gives their pages back once the engine is ready, and a
    killed engine's successor starts from weights written back from a reload, answering
    the same tokens."""
    worker, nc = await start(nats_server, engine_process=True)
    try:
        await worker.service.pool.add(ModelSpec(name="wide", path=str(wide_model)))
        await worker.service.warm(["wide"])
        runner = runner_of(worker)
        model = runner.loaded.model
        assert prepack.wanted(runner.loaded.spec, model) is not None  # dtype auto packs it here
        linears = [m for _, _, m, tied in prepack.packed_linears(model) if not tied]
        row_major = sum(m.weight.nbytes for m in linears)
        await until_released(runner, len(linears))  # packed on a thread while it serves: then given back
        # /dev/shm holds the shared weights, not the packed copy the pool's budget counts beside them.
        assert sum(m.size for m in shared_weights_maps(os.getpid())) >= weights_nbytes(model)
        assert weights_nbytes(model) < runner.loaded.nbytes
        assert len(linears) == 2 * 7
        assert resident_shared_bytes(os.getpid()) < runner.loaded.nbytes - 0.95 * row_major
        texts: list[list[str]] = []
        for round_ in range(2):
            texts.append([])
            for i, p in enumerate(PROMPTS):  # one at a time: a bfloat16 step rounds with its row count
                await request(worker.js, f"{round_}-{i}", p, healthy_params(0), model="wide")  # greedy
                done = (await serve(worker, 1))[f"{round_}-{i}"]
                assert done.type == "chat.completed" and done.text, done
                texts[-1].append(done.text)
            if round_ == 0:
                first = runner.pid
                os.kill(first, signal.SIGKILL)
                end = time.monotonic() + 60
                while (runner.pid == first or not runner.ready.is_set()) and time.monotonic() < end:
                    await asyncio.sleep(0.05)
                assert runner.pid != first and runner.ready.is_set()
                await until_released(runner, len(linears))  # given back again once the new one packed
        assert texts[1] == texts[0]
    finally:
        await stop_worker(worker, nc)


@pytest.mark.parametrize("killed", ["engine", "fork server"])
async def test_a_killed_engine_process_gives_back_what_it_held_and_is_started_again(nats_server, killed):
    """Killed with -9: the engine process, or the fork server it came from (which takes
    the engine with it; the next engine is forked from a new one)."""
    worker, nc = await start(nats_server, engine_process=True)
    try:
        await worker.service.warm([MODEL, MODEL])  # started before any request, once per model
        runner = runner_of(worker)
        assert runner.ready.is_set()
        engines = [p for p in psutil.Process().children(recursive=True) if p.name() == "arena-engine"]
        assert [p.pid for p in engines] == [runner.pid]  # forked from the fork server, named for ps
        first = runner.pid
        server = psutil.Process(first).ppid()
        long = healthy_params(0).model_copy(update={"max_tokens": 200})
        for i in range(3):
            await request(worker.js, f"held{i}", PROMPTS[i], long)
        for msg in await worker.sub.fetch(3, timeout=10):
            await worker.service.submit(decode(msg.data), msg)
        end = time.monotonic() + 20
        while not any(j.generated for j in worker.service.jobs.values()) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        assert any(j.generated for j in worker.service.jobs.values()), "no request started generating"
        os.kill(first if killed == "engine" else server, signal.SIGKILL)
        # Given back (naked), then pulled again and continued by the next engine process
        # from the chunks stored: each ends once, with every chunk once (serve's audit).
        resumed = REGISTRY.get_sample_value("arena_resumed_tokens_total") or 0.0
        done = await serve(worker, 3, timeout=90)
        assert {done[f"held{i}"].type for i in range(3)} == {"chat.completed"}
        assert runner.pid != first
        assert (psutil.Process(runner.pid).ppid() == server) == (killed == "engine")
        assert (REGISTRY.get_sample_value("arena_resumed_tokens_total") or 0.0) > resumed, "nothing was continued"
        for i in range(3):  # the same text an unbroken run gives
            await request(worker.js, f"ref{i}", PROMPTS[i], long)
        ref = await serve(worker, 3, timeout=90)
        assert [done[f"held{i}"].text for i in range(3)] == [ref[f"ref{i}"].text for i in range(3)]
        await request(worker.js, "after", PROMPTS[1], healthy_params(1))
        after = await serve(worker, 1, timeout=60)
        assert after["after"].type == "chat.completed" and after["after"].text
    finally:
        await stop_worker(worker, nc)


async def test_a_model_with_no_room_in_dev_shm_runs_its_engine_on_a_thread(nats_server, monkeypatch, caplog):
    """An engine process reads the weights from /dev/shm; where it is too small for them
    (a container's 64 MB), the model is served by an engine thread and the log says why."""
    monkeypatch.setattr(factory_module, "shm_room", lambda nbytes: False)
    worker, nc = await start(nats_server, engine_process=True)
    try:
        await request(worker.js, "small-shm", PROMPTS[0], healthy_params(0))
        done = await serve(worker, 1)
        assert done["small-shm"].type == "chat.completed"
        assert isinstance(runner_of(worker), EngineRunner)
        assert "/dev/shm has no room" in caplog.text
    finally:
        await stop_worker(worker, nc)


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_an_evicted_models_engine_is_stopped(nats_server, engine_process):
    """A pool with room for one model: serving a second evicts the first, and its engine
    (thread or process, which hold its weights) is stopped with it."""
    worker, nc = await start(nats_server, engine_process=engine_process)
    pool = worker.service.pool
    try:
        await pool.add(ModelSpec(name="other", path=str(STORIES)))
        await request(worker.js, "a", PROMPTS[0], healthy_params(0))
        await serve(worker, 1)
        (first,) = worker.service.runners.values()
        pool.budget_bytes = first.loaded.nbytes + 1  # room for one model from now on
        await request(worker.js, "b", PROMPTS[1], healthy_params(1), model="other")
        done = await serve(worker, 1)
        assert done["b"].type == "chat.completed"
        assert pool.resident() == ["other"]
        end = time.monotonic() + 10
        while first in worker.service.runners.values() and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert [r.name for r in worker.service.runners.values()] == ["other"]
        if engine_process:
            assert not psutil.pid_exists(first.pid) or psutil.Process(first.pid).status() == psutil.STATUS_ZOMBIE
        else:
            assert not first._thread.is_alive()
    finally:
        await stop_worker(worker, nc)


async def test_an_engine_process_that_cannot_start_is_not_restarted_in_a_loop(monkeypatch):
    monkeypatch.setattr(engine_process, "RESTART_AFTER_S", 1.0)
    loaded = load_model(ModelSpec(name=MODEL, path=str(STORIES)))
    failed: list = []
    # An engine of no rows cannot be built: the child fails as it starts, every time.
    config = EngineConfig(max_batch_size=0)
    runner = engine_process.ProcessRunner(loaded, config, asyncio.get_running_loop(), failed.extend)
    try:
        first = runner.pid
        end = time.monotonic() + 60
        while runner._dead_since is None and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert runner._dead_since is not None, "the child that cannot load did not end"
        await asyncio.sleep(0.5)
        assert runner.pid == first, "restarted at once"
        req = GenRequest("r", [1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(RetryableError):
            runner.add(req)
        await asyncio.sleep(1.0)
        runner.add(req)  # due: a new child is started for it, off the loop (and fails the same way)
        end = time.monotonic() + 30
        while runner.pid == first and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert runner.pid != first
        while not failed and time.monotonic() < end:  # it held the request: given back when it died
            await asyncio.sleep(0.05)
        assert [(o.request_id, o.finish_reason) for o in failed] == [("r", "lost")]
    finally:
        runner.stop()


CONSUMER = textwrap.dedent(
    """
    import asyncio, sys
    from consumers.inference.config import EngineConfig
    from consumers.inference.runners.process import ProcessRunner
    from consumers.inference.model_loading import ModelSpec, load_model, weights_nbytes

    async def main():
        loaded = load_model(ModelSpec(name="m", path=sys.argv[1]))
        config = EngineConfig(max_batch_size=4, torch_threads=1)
        runner = ProcessRunner(loaded, config, asyncio.get_running_loop(), lambda outs: None)
        await asyncio.to_thread(runner.ready.wait, 120)
        print(runner.pid, flush=True)
        await asyncio.sleep(300)

    asyncio.run(main())
    """
)


def test_the_engine_process_ends_with_a_consumer_killed_with_9():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    parent = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, str(STORIES)], stdout=subprocess.PIPE, text=True, env=env, cwd=os.getcwd()
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert psutil.pid_exists(child)
        parent.kill()
        parent.wait(timeout=10)
        end = time.monotonic() + 10
        while time.monotonic() < end:
            try:
                if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"engine process {child} outlived its consumer")
    finally:
        parent.kill()


async def test_a_starting_engine_process_profiles_its_steps_and_a_request_is_served_as_without(nats_server):
    """The step profile (ARENA_STEP_PROFILE, on by default) times decode steps in a starting
    engine process, one request alone and every slot full, before it says ready: the
    worker's load (what its heartbeats carry, what admission judges a first burst by) has
    both once the model is warm. Requests that come while it runs wait for it; the
    profile's requests reach neither the worker's jobs nor its events, and the requests
    get the tokens they get with no profile (greedy and seeded)."""
    texts = {}
    for profile in (False, True):
        worker, nc = await start_worker(
            nats_server.url, engine_process=True, torch_threads=1, step_profile=profile, step_figures_dir=""
        )  # no figures kept by an earlier engine: this one profiles
        try:
            if profile:  # sent first: they arrive while the engine starts and profiles
                for i, p in enumerate(PROMPTS):
                    await request(worker.js, f"{profile}-{i}", p, healthy_params(i))
            await worker.service.warm([MODEL])
            runner = runner_of(worker)
            if profile:
                load = runner.load()
                assert load.full_batch == runner.max_batch_size == 16 and load.full_step_s
                assert load.step_s and load.alone_step_s  # (real steps may have joined the small ones)
                # The worker's /metrics shows them (arena_engine_step_seconds{model,batch}).
                families = {f.name: f for f in LoadCollector(worker.service).collect()}
                shown = {s.labels["batch"]: s.value for s in families["arena_engine_step_seconds"].samples}
                assert shown == {"alone": load.alone_step_s, "small": load.step_s, "full": load.full_step_s}
            else:
                assert runner.load().step_s is None and runner.load().full_step_s is None
                for i, p in enumerate(PROMPTS):
                    await request(worker.js, f"{profile}-{i}", p, healthy_params(i))
            done = await serve(worker, len(PROMPTS))
        finally:
            await stop_worker(worker, nc)
        assert not [rid for rid in done if rid.startswith(PROFILE_PREFIX)]
        assert all(done[f"{profile}-{i}"].type == "chat.completed" for i in range(len(PROMPTS))), done
        texts[profile] = [done[f"{profile}-{i}"].text for i in range(len(PROMPTS))]
    assert texts[True] == texts[False]
