"""The inference consumer: pulls PromptAccepted into its model engines, publishes what they generate."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import psutil
import torch
from nats.aio.msg import Msg

from consumers.inference import admin
from consumers.inference.metrics import register_pool
from consumers.inference.model_loading import load_model, load_models_config
from consumers.inference.pool import ModelPool
from consumers.inference.runners import forks
from consumers.inference.settings import InferenceSettings
from consumers.inference.worker.worker import InferenceService
from events import decode, subjects, topology
from events.fleet import InferenceBeat, ProcessBeat
from events.models import ChatCancelled, PromptAccepted
from runtime.consume import DurableConsumer
from runtime.process import Process, ProcessRuntime, decode_or_term, serve

log = logging.getLogger(__name__)


def budget_bytes(settings: InferenceSettings) -> int:
    if settings.memory_budget_mb:
        return int(settings.memory_budget_mb * 2**20)
    return int(psutil.virtual_memory().total * 0.6)


def build_app(settings: InferenceSettings | None = None) -> Process:
    settings = settings or InferenceSettings()
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    specs = load_models_config(settings.models_config, settings.models_dir)
    pool = ModelPool(
        specs,
        budget_bytes(settings),
        gpu_memory_fraction=settings.cuda_memory_fraction,
        loader=functools.partial(load_model, cache=settings.model_cache),
    )

    adding: set[str] = set()  # models `arena models add` is loading (admin.apply)

    def describe(beat: ProcessBeat) -> InferenceBeat:
        specs = pool.specs()
        return InferenceBeat(
            **beat.base(),
            models=tuple(s.name for s in specs),
            resident=tuple(pool.resident()),
            loading=tuple(sorted(adding)),
            unavailable=tuple(service.unavailable()),
            resident_bytes=pool.stats.resident_bytes,
            context=service.token_rooms(),
            defaults={s.name: d for s in specs if (d := s.defaults()) is not None},
            owners={s.name: s.owner_name() for s in specs},
            jobs=len(service.jobs),
            held=len(service.holding),
            acks=tuple(service.ack_subjects()),
            load=service.load(),
            engine=settings.engine,
        )

    runtime = ProcessRuntime(topology.INFERENCE.name, settings, describe)
    service = InferenceService(
        settings,
        pool,
        runtime.publish,
        recorded=runtime.recorded,
        publish_nowait=runtime.publish_nowait,
        live=runtime.publish_live,
    )

    async def on_accepted(message: Msg) -> None:
        event = await decode_or_term(topology.INFERENCE.name, message, PromptAccepted)
        if event is None:
            return
        async with service.held(message):
            runtime.beat_now()  # its ack subject in a beat at once: a kill -9 from now on hands it on
            await service.wait_for_room()
            await service.submit(event, message)

    # Micro-batches form in the engine, not in the fetch: continuous mode admits
    # newcomers at every decode step; static mode waits up to max_wait_ms for a fuller
    # batch. A fetch takes the room this worker has; every message fetched is held at
    # once (kept alive while it waits for room), hence a worker for each.
    subscriber = DurableConsumer(topology.INFERENCE, on_accepted, "manual", workers=service.limit(), batch=service.room)

    async def on_cancel(msg) -> None:
        if isinstance(event := decode(msg.data), ChatCancelled):
            service.cancel(event.request_id)

    @asynccontextmanager
    async def serving(runtime: ProcessRuntime) -> AsyncIterator[None]:
        """Models warm before the first pull; on stop (pulls stopped), what is held is
        finished within the drain grace or given back, then the engine processes end."""
        register_pool(pool, service)
        await runtime.connection().subscribe(subjects.CANCEL_SUBJECT, cb=on_cancel)
        await runtime.connection().subscribe(
            subjects.ADMIN_MODELS,
            cb=admin.handler(
                pool, settings.instance_id, settings.models_dir, settings.default_model, service.warm, adding
            ),
        )
        service.start()
        rest: asyncio.Task | None = None
        try:
            warm = [w for w in settings.warm_models or [settings.default_model] if any(s.name == w for s in specs)]
            rest = await warm_default_first(service, warm, settings.default_model)
            log.info("warm: %s, pulling; metrics on :%d", pool.resident(), runtime.endpoint.port)
            yield
            naked = await service.drain(settings.drain_grace_s)
            log.info("drained; %d unfinished requests given back", naked)
        finally:
            if rest is not None and not rest.done():
                rest.cancel()
                with suppress(asyncio.CancelledError):
                    await rest
            await service.stop()  # its engine processes first,
            await asyncio.to_thread(forks.stop)  # then what they were forked from: nothing is left behind

    return Process(runtime, subscriber, serving)


async def warm_default_first(service: InferenceService, names: list[str], default: str) -> asyncio.Task | None:
    """Warm the default model (else the first of `names`) now, before the first pull, and
    the others beside the serving (the task, None when there are none): a worker
    restarted under a request handed on to it (kill -9, an OOM) answers it once one model
    is in, not all of them (`arena up`'s default stack: 4 SmolLM2 streams across a kill
    answered in 10.9 s against 11.7 s warming all three first, tests/e2e/test_faults.py).
    A request for a model still warming waits for that load (the pool loads each model
    once)."""
    names = sorted(names, key=lambda name: name != default)
    await service.warm(names[:1])
    if not names[1:]:
        return None

    def warmed(task: asyncio.Task) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("warming %s failed (each loads on its first request): %r", names[1:], exc)
        elif not task.cancelled():
            log.info("warm: %s", names)

    rest = asyncio.create_task(service.warm(names[1:]), name="warm-rest")
    rest.add_done_callback(warmed)
    return rest


def main() -> None:
    serve(build_app())
