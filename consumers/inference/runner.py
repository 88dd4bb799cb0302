"""Running a BatchEngine on its own thread, so the event loop never blocks on torch."""

from __future__ import annotations

import asyncio
import heapq
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

from consumers.inference.metrics import METRICS, PrefixCounts
from consumers.inference.protocol import (
    EngineBackend,
    EngineStats,
    GenRequest,
    SchedulerStats,
    StepOutput,
    StepRecord,
)
from events.fleet import EngineLoad
from runtime.steps import step_time

log = logging.getLogger(__name__)

#: Steps measured before a speed is trusted: the first ones after a load run cold (torch
#: warm-up, a burst's prefills, processes starting beside it) and would refuse in vain.
MIN_SAMPLES = 16


def typical_step(times) -> float:
    """The step time a request's tokens take on average: the mean of recent steps, the
    slowest tenth left out. A request lives through many steps, and under arrivals many
    of them carry a newcomer's prefill: the median (what this was before) took the
    decode-only step, 56 ms where a 60M model's requests stepped at ~105 ms, and let in
    requests that ended at their deadline. The trim keeps a rare outlier (warm-up, a
    collection) from moving it."""
    ordered = sorted(times)
    kept = ordered[: max(1, len(ordered) - len(ordered) // 10)]
    return sum(kept) / len(kept)


def steps_until_slot(running: list[int], waiting: list[int], slots: int) -> int:
    """Steps until a request queued behind `waiting` gets one of `slots`: each slot frees
    when its request has used its budget, and the waiting take the slots as they free."""
    ends = sorted(running)[: max(0, slots)]
    free = [0] * (slots - len(ends))
    heap = free + ends
    heapq.heapify(heap)
    for budget in waiting:
        heapq.heappush(heap, heapq.heappop(heap) + budget)
    return heap[0] if heap else 0


def estimate_finish(stats: SchedulerStats, max_batch: int, tokens: int) -> float | None:
    """When a request joining an engine now would end, at worst: once a slot is free for
    it (after the requests running and waiting ahead of it, each at its whole remaining
    budget), all its `tokens`, at the step time measured for the batch it joins; None
    until MIN_SAMPLES steps were measured. ``stats``: the engine runner's
    (:meth:`EngineRunner.stats`), read in this process or sent up by an engine process."""
    small, full = stats.samples
    running, waiting, load = stats.engine.running, stats.engine.waiting, stats.load
    # The steps measured at the batch it joins (those of the other kind while there are none).
    use_full = (full > 0 or small == 0) if len(running) * 2 >= max_batch else small == 0
    if (full if use_full else small) < MIN_SAMPLES:
        return None
    # The step time at the batch it will run in, extrapolated as the gateway does: at
    # a jump in load (16 users to 32) the steps measured so far are a smaller batch's.
    size = min(max_batch, len(running) + len(waiting) + 1)
    step = step_time(load.step_s, load.full_step_s, load.full_batch, max_batch, size, load.small_batch)
    step = max(step or 0.0, (load.full_step_s if use_full else load.step_s) or 0.0)
    return time.time() + (steps_until_slot(list(running), list(waiting), max_batch) + tokens) * step


def record_step(model: str, step: StepRecord) -> None:
    """One engine step in the worker's metrics: the batch it stepped, what it holds after."""
    if step.batch:
        METRICS.batch_size.labels(model).observe(step.batch)
    METRICS.steps.labels(model).inc()
    METRICS.running.labels(model).set(step.running)
    METRICS.waiting.labels(model).set(step.waiting)


class EngineRunner:
    """Steps one engine (one model version, any :class:`EngineBackend`) in a thread;
    outputs go back to the loop.

    ``max_wait_s``: the static mode's hold, how long a micro-batch may wait to fill before
    it starts (0: none, as in continuous mode). ``on_step(record, stats)`` is told of every
    step (default: the worker's metrics, :func:`record_step`)."""

    def __init__(
        self,
        engine: EngineBackend,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], None],
        max_wait_s: float = 0.0,
        on_step: Callable[[StepRecord, EngineStats], None] | None = None,
    ):
        self.engine = engine
        self.max_wait_s = max_wait_s
        self._first_wait: float | None = None
        self.loop = loop
        self.on_outputs = on_outputs
        self.name = engine.loaded.spec.name
        self.prefix_counts = PrefixCounts(self.name)
        self.on_step = on_step or self._record
        self._wake = threading.Event()
        self._stop = False
        # Outputs on their way to the loop: one wake-up carries every step's outputs that
        # piled up before the loop ran it (a wake-up is a syscall and a GIL hand-off).
        self._handoff_lock = threading.Lock()
        self._handoff: list[StepOutput] = []
        self._posted = False
        #: Recent decode step times (seconds) at small and at near-full batches: the
        #: gateway's admission estimates how long a new request would take from them.
        self._small: deque[float] = deque(maxlen=64)
        self._full: deque[float] = deque(maxlen=64)
        self._full_batches: deque[int] = deque(maxlen=64)  # the batch of each of those steps
        self._small_batches: deque[int] = deque(maxlen=64)
        #: Steps with one request in the batch: how fast a request goes alone (the median:
        #: decode steps, the one prefill of each request aside).
        self._alone: deque[float] = deque(maxlen=64)
        self.measured_at = 0.0
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    @property
    def loaded(self):
        return self.engine.loaded

    def add(self, req: GenRequest) -> None:
        self.engine.add(req)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        self._wake.set()

    def _hold_for_batch(self, queue: EngineStats) -> float:
        """Static mode: seconds to wait for a fuller micro-batch before starting one."""
        waiting = len(queue.waiting)
        if not self.max_wait_s or queue.running or not waiting or waiting >= self.engine.max_batch_size:
            self._first_wait = None
            return 0.0
        now = time.monotonic()
        self._first_wait = self._first_wait or now
        return max(0.0, self.max_wait_s - (now - self._first_wait))

    def _run(self) -> None:
        while not self._stop:
            queue = self.engine.stats()
            if not queue.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            hold = self._hold_for_batch(queue)
            if hold > 0:
                self._wake.wait(hold)
                self._wake.clear()
                continue
            self._first_wait = None
            batch = len(queue.running)
            started = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception:  # a broken step must not kill the thread silently
                log.exception("engine step failed", extra={"model": self.name})
                outputs = self.engine.fail_all()
            took = time.perf_counter() - started
            if (timed := self.engine.timed_steps()) is None:  # the step was one engine step
                if batch:
                    self._measure(batch, took)
            elif timed:  # what the streams timed of the server's step(s) read now: one sample
                self._measure(
                    max(1, round(statistics.fmean(b for b, _ in timed))), statistics.fmean(s for _, s in timed)
                )
            after = self.engine.stats()
            self.on_step(StepRecord(batch, len(after.running), len(after.waiting)), after)
            if outputs:
                self._post(outputs)

    def _record(self, step: StepRecord, stats: EngineStats) -> None:
        """The default ``on_step``: the step and the prefix cache's counts in this process's metrics."""
        record_step(self.name, step)
        self.prefix_counts.update(stats.prefix)

    def _post(self, outputs: list[StepOutput]) -> None:
        with self._handoff_lock:
            self._handoff += outputs
            if self._posted:
                return
            self._posted = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        """On the loop: every output posted since the last delivery, in step order."""
        with self._handoff_lock:
            outputs, self._handoff, self._posted = self._handoff, [], False
        self.on_outputs(outputs)

    def _measure(self, batch: int, took: float) -> None:
        """A step's time (with the prefill of requests joining it: under a steady load
        most steps admit someone, and that is the speed requests see)."""
        if batch * 2 >= self.engine.max_batch_size:
            self._full.append(took)
            self._full_batches.append(batch)
        else:
            self._small.append(took)
            self._small_batches.append(batch)
        if batch == 1:
            self._alone.append(took)
        self.measured_at = time.time()

    def finish_at(self, tokens: int) -> float | None:
        """When a request joining now would end, at worst (:func:`estimate_finish`)."""
        return estimate_finish(self.stats(), self.engine.max_batch_size, tokens)

    def stats(self) -> SchedulerStats:
        """The engine's queue, its load and the steps measured (at small and at near-full
        batches, of the last 64 each)."""
        queue = self.engine.stats()
        load = EngineLoad(
            running=len(queue.running),
            waiting=len(queue.waiting),
            max_batch=self.engine.max_batch_size,
            step_s=typical_step(self._small) if self._small else None,
            full_step_s=typical_step(self._full) if self._full else None,
            full_batch=statistics.median_low(self._full_batches) if self._full_batches else None,
            small_batch=statistics.median_low(self._small_batches) if self._small_batches else None,
            alone_step_s=statistics.median(self._alone) if len(self._alone) >= MIN_SAMPLES else None,
            measured_at=self.measured_at,
        )
        return SchedulerStats(queue, load, (len(self._small), len(self._full)))

    def load(self) -> EngineLoad:
        """What this engine holds and how fast it steps (for heartbeats)."""
        return self.stats().load

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.engine.close()
