"""The inference consumer: a FastStream app pulling micro-batches of PromptAccepted."""

from __future__ import annotations

import asyncio
import functools
import logging

import psutil
import torch
from faststream import FastStream
from faststream.nats import NatsBroker
from nats.aio.msg import Msg

from consumers.inference import admin, forks
from consumers.inference.metrics import register_pool
from consumers.inference.models import load_model, load_models_config
from consumers.inference.pool import ModelPool
from consumers.inference.service import InferenceService
from events import decode, subjects, topology
from events.fleet import InferenceBeat, ProcessBeat
from runtime import heap, jetstream
from runtime.consume import DurableConsumer
from runtime.process import ProcessRuntime, decode_or_term
from runtime.settings import InferenceSettings

log = logging.getLogger(__name__)


def budget_bytes(settings: InferenceSettings) -> int:
    if settings.memory_budget_mb:
        return int(settings.memory_budget_mb * 2**20)
    return int(psutil.virtual_memory().total * 0.6)


def build_app(settings: InferenceSettings | None = None) -> FastStream:
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

    def describe(beat: ProcessBeat) -> InferenceBeat:
        specs = pool.specs()
        return InferenceBeat(
            **beat.base(),
            models=tuple(s.name for s in specs),
            resident=tuple(pool.resident()),
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
    broker = NatsBroker(
        jetstream.servers(settings.nats_url), log_level=logging.DEBUG, security=jetstream.broker_security(settings)
    )

    async def on_accepted(message: Msg) -> None:
        event = await decode_or_term(topology.INFERENCE.name, message)
        if event is None:
            return
        async with service.held(message):
            await service.wait_for_room()
            await service.submit(event, message)

    # Micro-batches form in the engine, not in the fetch: continuous mode admits
    # newcomers at every decode step; static mode waits up to max_wait_ms for a fuller
    # batch. A fetch takes the room this worker has; every message fetched is held at
    # once (kept alive while it waits for room), hence a worker for each.
    subscriber = DurableConsumer(topology.INFERENCE, on_accepted, "manual", workers=service.limit(), batch=service.room)

    async def on_cancel(msg) -> None:
        service.cancel(decode(msg.data).request_id)

    app = FastStream(broker)

    @app.on_startup
    async def _start() -> None:
        register_pool(pool)
        await runtime.start()
        await runtime.connection().subscribe(subjects.CANCEL_SUBJECT, cb=on_cancel)
        await runtime.connection().subscribe(
            subjects.ADMIN_MODELS,
            cb=admin.handler(pool, settings.instance_id, settings.models_dir, settings.default_model),
        )
        service.start()
        warm = settings.warm_models or [settings.default_model]
        await service.warm([w for w in warm if any(s.name == w for s in specs)])
        log.info("warm: %s; metrics on :%d", pool.resident(), runtime.endpoint.port)

    @app.after_startup
    async def _ready() -> None:
        heap.freeze()  # torch, transformers and the warm models: a full collection took 280 ms
        assert runtime.js is not None
        await subscriber.start(runtime.js)
        runtime.ready = True

    @app.on_shutdown
    async def _drain() -> None:
        runtime.ready = False
        await subscriber.stop()  # stop pulling before finishing what we hold
        naked = await service.drain(settings.drain_grace_s)
        log.info("drained; %d unfinished requests given back", naked)
        await service.stop()  # its engine processes first,
        await asyncio.to_thread(forks.stop)  # then what they were forked from: nothing is left behind
        await runtime.stop()

    return app


def main() -> None:
    asyncio.run(build_app().run())
