"""The worker's watchdog: no job is held without a terminal event. The engine ends a
request at its deadline, so a job still open a margin past it was lost on the way (a
stuck or dead engine thread, an output that never came back); holding it would leave its
client waiting and, with enough of them, stop the worker pulling. It also stops the
runners of model versions the pool let go."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from consumers.inference.metrics import METRICS
from consumers.inference.runners.base import Runner
from consumers.inference.worker.jobs import Ended, Job
from consumers.inference.worker.outbox import Outbox
from events.models import ChatFailed

log = logging.getLogger(__name__)


class Watchdog:
    """``margin_s``: how long past its deadline a job may stay open before the watchdog
    fails it (the audit calls a terminal missing 5 s past it). ``period_s``: how often it
    looks. ``prune()``: the runners to stop, their models gone from the pool."""

    def __init__(
        self,
        jobs: dict[str, Job],
        outbox: Outbox,
        prune: Callable[[], list[Runner]],
        margin_s: float = 2.0,
        period_s: float = 0.5,
    ) -> None:
        self.jobs = jobs
        self.outbox = outbox
        self.prune = prune
        self.margin_s = margin_s
        self.period_s = period_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self.reap_overdue(time.time())
                for runner in self.prune():
                    await asyncio.to_thread(runner.stop)
            except Exception:
                log.exception("watchdog pass failed")

    def reap_overdue(self, now: float) -> int:
        """Fail every open job ``margin_s`` past its deadline; returns how many."""
        late = [j for j in self.jobs.values() if not j.closed and now > j.event.deadline_at + self.margin_s]
        for job in late:
            e = job.event
            log.error("no terminal event %.1f s past the deadline; failing it", now - e.deadline_at, extra=job.ids)
            METRICS.watchdog_reaped.labels(e.model).inc()
            METRICS.deadline_misses.labels(e.model).inc()
            METRICS.requests.labels(e.model, "deadline").inc()
            job.closed = True
            job.runner.cancel(e.request_id)  # in case the engine still holds it
            message = "the worker lost this request; failed by its watchdog after the deadline"
            failed = ChatFailed(**job.ids, code="deadline_exceeded", message=message, chunks=job.seq)
            self.outbox.put(Ended(job, failed, reaped=True))
        return len(late)
