"""An engine's step figures: the decode steps it measured (at small and at near-full
batches, and alone), the share of recent step time newcomers' prefills took, the busiest
recent batch; what its heartbeats carry (`EngineLoad`) and what the worker's own
too-late check reads (`estimate_finish`). Kept in a file between processes, and
rescaled when an idle probe finds the machine changed (consumers/inference/runners/probes.py).
Written by the engine runner's thread, read from any."""

from __future__ import annotations

import heapq
import json
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from consumers.inference.engine_io import EngineStats, SchedulerStats
from events.fleet import EngineLoad
from runtime.steps import PEAK_WINDOW_S, PREFILL_WINDOW_S, shared_batch, step_time, stretch

#: Steps measured before a speed is trusted: the first ones after a load run cold (torch
#: warm-up, a burst's prefills, processes starting beside it) and would refuse in vain.
MIN_SAMPLES = 16

#: An engine's measured steps are kept in a file (``EngineRunner(figures=...)``), written
#: at the profile's end and every FIGURES_EVERY_S while it lives; an engine of the same
#: model, settings and machine starting within FIGURES_MAX_AGE_S of the last write (a
#: worker restarted after a kill -9 or an OOM) takes them instead of profiling: its
#: requests waited 3.5-9 s for a profile on a 2-core VM.
FIGURES_EVERY_S = 30.0
FIGURES_MAX_AGE_S = 900.0


def typical_step(times) -> float:
    """The step time a request's tokens take on average: the mean of recent decode steps,
    the slowest tenth left out (a rare outlier, warm-up or a collection, does not move it).
    Newcomers' prefills are counted apart (`EngineLoad.prefill_share`): they took the
    median from 56 ms to ~105 ms for a 60M model's requests under arrivals, and a step
    figure with them in it, grown to a burst's batch, refused most of the burst."""
    ordered = sorted(times)
    kept = ordered[: max(1, len(ordered) - len(ordered) // 10)]
    return sum(kept) / len(kept)


def step_line(batches: list[int], times: list[float]) -> Callable[[int], float]:
    """The least-squares line of step time over batch through the steps (`batches`,
    `times`), fitted again without the slowest tenth above it (as `typical_step` leaves
    them out: a collection, a warm-up), as a function of the batch; flat at the steps'
    typical time where the line would fall with the batch (a bigger batch never steps
    faster). Never under the fastest step measured."""

    def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        spread = sum((b - mean_b) ** 2 for b, _ in points)
        slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / spread if spread else 0.0
        return mean_t - slope * mean_b, slope

    points = list(zip(batches, times))  # noqa: B905 - a reader on another thread may see one pending
    base, slope = fit(points)
    kept = sorted(points, key=lambda p: p[1] - (base + slope * p[0]))[: max(2, len(points) - len(points) // 10)]
    if len({b for b, _ in kept}) > 1:
        base, slope = fit(kept)
    if slope <= 0:
        flat = typical_step(times)
        return lambda batch: flat
    fastest = min(times)
    return lambda batch: max(fastest, base + slope * batch)


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
    # The step time at the batch its steps will share (`runtime.steps.shared_batch`, as
    # the gateway judges it; the batch it joins without the window's mean), off the
    # figures' line as the gateway reads it: at a jump in load (16 users to 32) the steps
    # measured so far are a smaller batch's. (Never less than the figure of the kind it
    # joins, at the batch it joins, it took the line's value at the largest batch
    # measured for a turn joining 17, and the workers refused at 2 requests/s turns that
    # admission had let on.)
    size = min(max_batch, len(running) + len(waiting) + 1)
    if load.mean_running is not None and running:  # the batch its steps share, as admission judges it
        size = shared_batch(running, len(waiting), load.mean_running, tokens, max_batch)
    step = decode_step(load, size) or 0.0
    if size == 1 and load.alone_step_s is not None:  # alone, as the gateway judges an idle fleet
        step = load.alone_step_s
    elif running or waiting:  # others' prefills stretch its steps, as the gateway counts them
        step *= stretch(load.prefill_share, load.measured_at, time.time())
    return time.time() + (steps_until_slot(list(running), list(waiting), max_batch) + tokens) * step


def decode_step(load: EngineLoad, batch: int) -> float | None:
    """An engine's decode step at `batch`, from its load's figures (`runtime.steps.step_time`)."""
    return step_time(load.step_s, load.full_step_s, load.full_batch, load.max_batch, batch, load.small_batch)


class StepFigures:
    """What one engine measured of its steps (see the module doc). ``max_batch``: its slots."""

    #: The figures kept in the file (its keys are these names with a leading underscore).
    KEPT = ("small", "small_batches", "full", "full_batches", "alone", "alone_idle")
    #: The steps a probe rescales by when they ran (`at`).
    TIMED = ("small", "full", "alone")

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        #: Recent decode step times (seconds) at small and at near-full batches: the
        #: gateway's admission estimates how long a new request would take from them.
        self.small: deque[float] = deque(maxlen=64)
        self.full: deque[float] = deque(maxlen=64)
        self.full_batches: deque[int] = deque(maxlen=64)  # the batch of each of those steps
        self.small_batches: deque[int] = deque(maxlen=64)
        #: Steps with one request in the batch: how fast a request goes alone (the median).
        self.alone: deque[float] = deque(maxlen=64)
        #: ... and those of the profile's and the idle probes' lone request, the newest.
        self.alone_idle: deque[float] = deque(maxlen=MIN_SAMPLES)
        #: When each of small, full and alone's steps ran (monotonic; -inf: kept by an
        #: earlier process): a probe rescales those that ran before the last probe.
        self.at: dict[str, deque[float]] = {name: deque(maxlen=64) for name in self.TIMED}
        #: When the last probe (or the profile) began: the steps before it are a probe's to rescale.
        self.probes_before = -math.inf
        #: Recent steps as (monotonic end, seconds, of which newcomers' prefill): the share.
        self.recent: deque[tuple[float, float, float]] = deque(maxlen=512)
        #: The busiest batch of the served steps of each recent second, as (monotonic
        #: second, requests running): a second's entry, whatever the steps' pace.
        self.busiest: deque[tuple[int, int]] = deque(maxlen=int(PEAK_WINDOW_S) + 2)
        #: The served steps of the last PEAK_WINDOW_S as (monotonic end, batch x seconds):
        #: the batch the requests running then shared, on average (`mean_running`).
        self.served: deque[tuple[float, float]] = deque()
        self.first_served: float | None = None  # when the first served step began (monotonic)
        self.measured_at = 0.0
        #: `decode`'s figures and the count of changes they were worked out at (`_changed`):
        #: read from other threads, which may work them out while a step is measured.
        self._changes = 0
        self._decoded: tuple[int, EngineLoad] | None = None

    def measure(self, batch: int, took: float, fresh: int = 0, idle: bool = False) -> None:
        """A step's time: a decode step's (no newcomer in it) at its batch; a step that
        prefilled `fresh` newcomers counts its time past a decode step's at that batch as
        prefill, for the share (`prefill_share`). `idle`: the profile's own step."""
        self.measured_at = time.time()
        prefill = 0.0
        if fresh:
            decode = decode_step(self.decode(), batch)
            prefill = max(0.0, took - decode) if decode is not None else 0.0
        now = time.monotonic()
        self.recent.append((now, took, prefill))
        if fresh:
            return
        if batch * 2 >= self.max_batch:
            self.full.append(took)
            self.full_batches.append(batch)
            self.at["full"].append(now)
        else:
            self.small.append(took)
            self.small_batches.append(batch)
            self.at["small"].append(now)
        if batch == 1 and idle:
            self.alone_idle.append(took)
        elif batch == 1:
            self.alone.append(took)
            self.at["alone"].append(now)
        self._changes += 1  # after the steps are in: a reader's figures of before are stale

    def decode(self) -> EngineLoad:
        """The decode steps measured, as a load carries them (of the last 64 at small and
        at near-full batches each): once steps of a near-full batch and of two batch sizes
        or more were measured, the line through them all (`step_line`) at the smallest and
        the largest batch measured, so that the gateway's line between its two figures
        (`runtime.steps.step_time`) is that line. Each kind's typical step at its median
        batch read them off it: the near-full ones mixed the profile's steps at every slot
        (32) with a load's at 16-17, and their mean, put at the median batch, said 123-149 ms
        for llama.cpp's steps at 14-17 requests, which took 105-115 ms, stretch included."""
        changes, decoded = self._changes, self._decoded
        if decoded is None or decoded[0] != changes:
            decoded = self._decoded = (changes, self._decode())
        return decoded[1]

    def _decode(self) -> EngineLoad:
        small, full = self.small, self.full
        batches = [*self.small_batches, *self.full_batches]
        line = step_line(batches, [*small, *full]) if full and len(set(batches)) > 1 else None
        if line is not None:
            lo, hi = min(batches), max(batches)
            return EngineLoad(
                max_batch=self.max_batch,
                step_s=line(lo),
                full_step_s=line(hi),
                full_batch=hi,
                small_batch=lo,
            )
        return EngineLoad(
            max_batch=self.max_batch,
            step_s=typical_step(small) if small else None,
            full_step_s=typical_step(full) if full else None,
            full_batch=statistics.median_low(self.full_batches) if full else None,
            small_batch=statistics.median_low(self.small_batches) if small else None,
        )

    def alone_step(self, min_idle: int) -> float | None:
        """How fast a request goes alone: the median of the recent steps with one request
        in the batch (real prompts and answers, the stack's own work beside them), else,
        until MIN_SAMPLES of those ran, of the profile's and probes' lone request (at
        least `min_idle` of them: the profile's lone batch is cut short on a slow machine).
        Theirs is a lower bound (a short context, nothing streamed beside it: 51 ms for
        SmolLM2, whose 256-token answer then stepped ~55 ms and ended at 15.04 s in the
        stack), so it is not preferred once the real ones are measured."""
        if len(self.alone) >= MIN_SAMPLES:
            return statistics.median(self.alone)
        return statistics.median(self.alone_idle) if len(self.alone_idle) >= min_idle else None

    def prefill_share(self) -> float:
        """Of the steps in the last PREFILL_WINDOW_S, the share of their time that went to
        newcomers' prefills: under arrivals, a request's decode steps are stretched by it
        (`runtime.steps.stretch`: new requests' prompts join its steps)."""
        since = time.monotonic() - PREFILL_WINDOW_S
        recent = [(took, prefill) for at, took, prefill in list(self.recent) if at >= since]
        busy = sum(took for took, _ in recent)
        return min(1.0, sum(p for _, p in recent) / busy) if busy > 0 else 0.0

    def count_batch(self, batch: int, took: float = 0.0) -> None:
        """A served step's batch, into its second's entry, and the `took` seconds it ran
        for into the window's mean (the runner's thread)."""
        now = time.monotonic()
        second = int(now)
        if self.busiest and self.busiest[-1][0] == second:
            self.busiest[-1] = (second, max(batch, self.busiest[-1][1]))
        else:
            self.busiest.append((second, batch))
        if self.first_served is None:
            self.first_served = now - took
        self.served.append((now, batch * took))
        while self.served and self.served[0][0] < now - PEAK_WINDOW_S:
            self.served.popleft()

    def mean_running(self) -> float:
        """The requests running at once over the last PEAK_WINDOW_S (since the first
        served step, where that was later), time-weighted, idle time counted as none: by
        Little's law what a request admitted now shares its steps with, on average, while
        arrivals hold their pace (Poisson arrivals see the time average). The busiest
        batch of the window (`recent_running`) is above it by the load's swings: judged
        there, the llama.cpp backend refused at 2 requests/s turns estimated at 15-19 s
        that its server answered in 12-13 s."""
        if self.first_served is None:
            return 0.0
        now = time.monotonic()
        since = now - PEAK_WINDOW_S
        span = now - max(since, self.first_served)
        if span <= 0:
            return 0.0
        return sum(weight for at, weight in list(self.served) if at >= since) / span

    def recent_running(self) -> int:
        """The most requests a served step (not the profile's) ran in the last PEAK_WINDOW_S
        (to the second)."""
        since = time.monotonic() - PEAK_WINDOW_S
        return max((batch for second, batch in list(self.busiest) if second + 1 > since), default=0)

    def stats(self, queue: EngineStats, min_idle: int) -> SchedulerStats:
        """The engine's queue with its load: the figures and what it holds."""
        load = self.decode().model_copy(
            update={
                "running": len(queue.running),
                "waiting": len(queue.waiting),
                "alone_step_s": self.alone_step(min_idle),
                "prefill_share": self.prefill_share(),
                "recent_running": self.recent_running(),
                "mean_running": round(self.mean_running(), 2),
                "ends": tuple(sorted(queue.running)),
                "measured_at": self.measured_at,
            }
        )
        return SchedulerStats(queue, load, (len(self.small), len(self.full)))

    def rescale(self, ratio: float) -> None:
        """Every step measured before the last probe began, and the lone steps of the
        profile and probes, times `ratio` (`runners.kept.follow`)."""
        for name in self.TIMED:
            values, at = getattr(self, name), self.at[name]
            for i, t in enumerate(at):
                if t < self.probes_before:
                    values[i] *= ratio
        for i in range(len(self.alone_idle)):
            self.alone_idle[i] *= ratio
        self._changes += 1

    def keep(self, path: Path) -> None:
        """Write them to `path` (atomically: a reader sees the old or the new); the write's
        time says how fresh they are. OSError when it cannot."""
        kept: dict[str, object] = {f"_{name}": list(getattr(self, name)) for name in self.KEPT}
        kept |= {"written_at": time.time(), "measured_at": self.measured_at, "pid": os.getpid()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept))
        tmp.replace(path)

    def take(self, path: Path, min_full: int) -> tuple[float, object] | None:
        """Seed them from `path` if it was written within FIGURES_MAX_AGE_S with at least
        `min_full` steps of a full batch in it: (its age in seconds, the pid that wrote
        it); None when not taken (none, stale, unreadable)."""
        try:
            kept = json.loads(path.read_text())
            age = time.time() - float(kept["written_at"])
            if age > FIGURES_MAX_AGE_S or len(kept["_full"]) < min_full:
                return None
            seeds = {
                name: [(int if name.endswith("batches") else float)(x) for x in kept[f"_{name}"]] for name in self.KEPT
            }
        except (OSError, ValueError, KeyError, TypeError):
            return None
        for name, values in seeds.items():
            getattr(self, name).extend(values)
            if name in self.TIMED:
                self.at[name].extend([-math.inf] * len(values))
        self.probes_before = time.monotonic()  # the first probe rescales them all
        self.measured_at = float(kept.get("measured_at") or 0.0)
        self._changes += 1
        return age, kept.get("pid")
