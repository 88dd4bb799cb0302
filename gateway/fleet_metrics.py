"""The fleet as Prometheus series, from what the gateway already knows: the consumers'
state in JetStream (lag per durable) and the processes' heartbeats (who is ready, which
models are resident where, each model's queue).

Every gateway exports the same fleet figures (they are read from the same stream and
heartbeats), so queries take `max` over gateways, never `sum`.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from typing import Any

from prometheus_client.core import REGISTRY, GaugeMetricFamily

from events import subjects, topology
from events.models import DEFAULT_MAX_TOKENS
from gateway.admission.estimate import combine, estimate
from runtime.jetstream import NATS_DOWN

log = logging.getLogger(__name__)

#: How often every durable's state is read (admission reads its two more often itself).
LAG_POLL_S = 1.0


class FleetCollector:
    """Collected at scrape time from the pipeline's heartbeats and the last lag poll."""

    def __init__(self) -> None:
        self.pipeline: Any = None
        self.consumers: dict[str, Any] = {}  # durable -> its last ConsumerInfo
        #: Every model a worker has listed: a model nobody holds any more stays visible (0).
        self.served: set[str] = set()

    async def watch(self, pipeline: Any) -> None:
        """Follow `pipeline` (started) and poll every durable's state until cancelled."""
        self.pipeline = pipeline
        try:
            while True:
                for role in topology.consumers():
                    with suppress(*NATS_DOWN):
                        self.consumers[role.name] = await pipeline.js.consumer_info(subjects.STREAM, role.durable)
                await asyncio.sleep(LAG_POLL_S)
        finally:
            self.pipeline = None

    def collect(self):
        yield from self._lag()
        if self.pipeline is None:
            return
        try:
            families = list(self._fleet())
        except Exception:  # a scrape must not fail with the fleet's view: the other series still go out
            log.exception("fleet metrics unavailable")
            return
        yield from families

    def _fleet(self):
        fleet = self.pipeline.fleet()
        processes = GaugeMetricFamily("arena_fleet_processes", "Ready processes per role (heartbeats)", labels=["role"])
        for role in topology.ROLES:
            if role.name in fleet.ready:
                processes.add_metric([role.name], fleet.ready[role.name])
        yield processes
        self.served |= set(fleet.models)
        workers = GaugeMetricFamily(
            "arena_model_resident_workers", "Inference processes holding the model resident", labels=["model"]
        )
        queue = GaugeMetricFamily(
            "arena_model_queue_requests",
            "Requests the workers holding the model report: running, waiting, pulled",
            labels=["model"],
        )
        estimates = GaugeMetricFamily(
            "arena_model_queue_estimate_seconds",
            "Admission's estimate of when a new request of the default budget would finish",
            labels=["model"],
        )
        for model in sorted(self.served):
            workers.add_metric([model], len(fleet.models.get(model, ())))
            workers_queue = self.pipeline.queue(model)
            queue.add_metric([model], workers_queue.requests)
            # As admission sees it: the stream's requests (any model's) are ahead too.
            q = combine(workers_queue, self.pipeline.stream_state, 0, 0, DEFAULT_MAX_TOKENS)
            est = estimate(q, DEFAULT_MAX_TOKENS, self.pipeline.settings.admission_overhead_s)
            if est.finish_s != float("inf"):
                estimates.add_metric([model], est.finish_s)
        yield from (workers, queue, estimates)
        memory = GaugeMetricFamily(
            "arena_fleet_resident_bytes", "Resident model weights per inference process", labels=["instance"]
        )
        for beat in self.pipeline.workers():
            memory.add_metric([beat.instance], beat.resident_bytes)
        yield memory

    def _lag(self):
        pending = GaugeMetricFamily(
            "arena_consumer_pending", "Messages in the stream not yet delivered to the durable", labels=["durable"]
        )
        acks = GaugeMetricFamily(
            "arena_consumer_ack_pending", "Messages delivered to the durable and not yet acked", labels=["durable"]
        )
        redelivered = GaugeMetricFamily(
            "arena_consumer_redelivered", "Unacked messages of the durable delivered more than once", labels=["durable"]
        )
        for durable, info in sorted(self.consumers.items()):
            pending.add_metric([durable], info.num_pending or 0)
            acks.add_metric([durable], info.num_ack_pending or 0)
            redelivered.add_metric([durable], info.num_redelivered or 0)
        yield from (pending, acks, redelivered)


FLEET = FleetCollector()
REGISTRY.register(FLEET)
