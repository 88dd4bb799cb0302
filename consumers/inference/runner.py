"""Running a BatchEngine on its own thread, so the event loop never blocks on torch."""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

from consumers.inference import probes
from consumers.inference.metrics import METRICS, PrefixCounts
from consumers.inference.protocol import (
    EngineBackend,
    EngineStats,
    GenRequest,
    SchedulerStats,
    StepOutput,
    StepRecord,
)
from consumers.inference.sampling import SamplingParams
from events.fleet import EngineLoad
from runtime.steps import PEAK_WINDOW_S, PREFILL_WINDOW_S, step_time, stretch

log = logging.getLogger(__name__)

#: Steps measured before a speed is trusted: the first ones after a load run cold (torch
#: warm-up, a burst's prefills, processes starting beside it) and would refuse in vain.
MIN_SAMPLES = 16

#: A starting engine's profile (`EngineRunner(profile=True)`): decode steps it times with
#: synthetic requests, one alone and one in every slot, before it takes a real request,
#: so that admission judges a first burst by a measured full batch rather than by small
#: batches grown in proportion (as vLLM profiles its engine before it serves).
PROFILE_STEPS = MIN_SAMPLES
#: Tokens of the synthetic prompt (it stays out of the prefix cache: `GenRequest.cache`).
PROFILE_PROMPT_TOKENS = 8
#: A profile that has not ended by then (a llama-server that never came up) is given up:
#: the engine serves, its figures come from real steps.
PROFILE_TIMEOUT_S = 180.0
#: Each of the profile's batches stops after this long once it has PROFILE_MIN_FULL_STEPS
#: decode steps: on a slow CPU its 16 steps at 64 rows took 18 s (SmolLM2 in float32 on
#: an AVX2 EPYC, 0.8 s a step), and a restarted worker's requests waited them out; beside
#: a CPU hog its lone request's steps took 2 s each (the idle probes correct them after).
PROFILE_FULL_BUDGET_S = 3.0
PROFILE_MIN_FULL_STEPS = 4

PROFILE_PREFIX = "step-profile-"
#: An idle engine's probe (`EngineRunner._probe`, consumers/inference/probes.py) is given
#: up past this, its figure unused (a probe is a few steps: this is a stuck engine).
PROBE_TIMEOUT_S = 30.0

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


def newcomers(outputs: list[StepOutput]) -> int:
    """Requests whose first tokens a step's outputs carry: those it prefilled."""
    return sum(1 for o in outputs if o.new_token_ids and o.completion_tokens == len(o.new_token_ids))


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
    step = decode_step(load, size)
    step = max(step or 0.0, (load.full_step_s if use_full else load.step_s) or 0.0)
    if size == 1 and load.alone_step_s is not None:  # alone, as the gateway judges an idle fleet
        step = load.alone_step_s
    elif running or waiting:  # others' prefills stretch its steps, as the gateway counts them
        step *= stretch(load.prefill_share, load.measured_at, time.time())
    return time.time() + (steps_until_slot(list(running), list(waiting), max_batch) + tokens) * step


def decode_step(load: EngineLoad, batch: int) -> float | None:
    """An engine's decode step at `batch`, from its load's figures (`runtime.steps.step_time`)."""
    return step_time(load.step_s, load.full_step_s, load.full_batch, load.max_batch, batch, load.small_batch)


def record_step(model: str, step: StepRecord) -> None:
    """One engine step in the worker's metrics: the batch it stepped, what it holds after."""
    if step.batch:
        METRICS.batch_size.labels(model).observe(step.batch)
    METRICS.steps.labels(model).inc()
    METRICS.running.labels(model).set(step.running)
    METRICS.waiting.labels(model).set(step.waiting)
    if step.threads:
        METRICS.step_threads.labels(model).set(step.threads)


class EngineRunner:
    """Steps one engine (one model version, any :class:`EngineBackend`) in a thread;
    outputs go back to the loop.

    ``max_wait_s``: the static mode's hold, how long a micro-batch may wait to fill before
    it starts (0: none, as in continuous mode). ``on_step(record, stats)`` is told of every
    step (default: the worker's metrics, :func:`record_step`) but the profile's own;
    ``before_step()`` is called before each and returns the torch threads it takes, if it
    sets them (cores.py).
    ``profile``: first time decode steps at one request and at every slot (:meth:`_profile`);
    requests added meanwhile wait for it (`profiled`). ``figures``: the file its measured
    steps are kept in (see FIGURES_EVERY_S); a fresh one there stands for the profile."""

    def __init__(
        self,
        engine: EngineBackend,
        loop: asyncio.AbstractEventLoop,
        on_outputs: Callable[[list[StepOutput]], None],
        max_wait_s: float = 0.0,
        on_step: Callable[[StepRecord, EngineStats], None] | None = None,
        profile: bool = False,
        figures: str | None = None,
        before_step: Callable[[], int | None] | None = None,
    ):
        self.engine = engine
        self.before_step = before_step
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
        #: Steps with one request in the batch: how fast a request goes alone (the median).
        self._alone: deque[float] = deque(maxlen=64)
        #: ... and those of the profile's and the idle probes' lone request, the newest.
        self._alone_idle: deque[float] = deque(maxlen=MIN_SAMPLES)
        #: When each of _small, _full and _alone's steps ran (monotonic; -inf: kept by an
        #: earlier process): a probe rescales those that ran before the last probe.
        self._at: dict[str, deque[float]] = {name: deque(maxlen=64) for name in self._TIMED}
        #: The idle probes (`_probe`): when the next is due, the CPU's pressure, the probe's
        #: step times while it runs, and when the engine last stepped for a request.
        self._probes = probes.ProbeClock()
        self._pressure = probes.Pressure()
        self._pressure_now: float | None = None
        self._probe_times: list[float] | None = None
        self._probing = False
        self._idle_since = -math.inf
        self._probes_before = -math.inf  # when the last probe began: a rescale's edge
        #: Recent steps as (monotonic end, seconds, of which newcomers' prefill): the share.
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=512)
        #: The busiest batch of the served steps of each recent second, as (monotonic
        #: second, requests running): a second's entry, whatever the steps' pace.
        self._busiest: deque[tuple[int, int]] = deque(maxlen=int(PEAK_WINDOW_S) + 2)
        self.measured_at = 0.0
        #: Set once the profile has ended (at once without one); until then real requests
        #: and cancels wait in `_held`, in their order. The profile's requests in the engine.
        self.profiled = threading.Event()
        self._held: list[GenRequest | str] = []
        self._held_lock = threading.Lock()
        self._profiling: set[str] = set()
        self._figures = Path(figures) if figures else None
        self._figures_saved = 0.0
        self._probing_on = profile  # the idle probes follow the profile's figures
        if not profile or self._take_figures():
            self.profiled.set()
        else:
            self._probes.probed(time.monotonic(), None)  # the profile measures now
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    @property
    def loaded(self):
        return self.engine.loaded

    def add(self, req: GenRequest) -> None:
        self._apply(req)

    def cancel(self, request_id: str) -> None:
        self._apply(request_id)

    def _apply(self, command: GenRequest | str) -> None:
        """Into the engine; while the profile or a probe runs, a request (or a cancel, by
        its id) waits for it, in order (a probe gives way at its next step). Under the
        lock a probe starts with: no request joins one."""
        with self._held_lock:
            if not self.profiled.is_set() or self._probing:
                self._held.append(command)
                return
            if isinstance(command, str):
                self.engine.cancel(command)
            else:
                self.engine.add(command)
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
        if not self.profiled.is_set():
            self.engine.wait_packed(PROFILE_TIMEOUT_S)  # the profile times the steps it will serve with
            self._profile()
        while not self._stop:
            if self._figures is not None and time.monotonic() - self._figures_saved >= FIGURES_EVERY_S:
                self._keep_figures()
            queue = self.engine.stats()
            if not queue.has_work():
                self._idle()
                continue
            hold = self._hold_for_batch(queue)
            if hold > 0:
                self._wake.wait(hold)
                self._wake.clear()
                continue
            self._first_wait = None
            self._step(len(queue.running))
            self._idle_since = time.monotonic()

    def _step(self, batch: int) -> None:
        """One engine step of `batch` running requests: timed, told, its outputs posted."""
        threads = self.before_step() if self.before_step is not None else None
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:  # a broken step must not kill the thread silently
            log.exception("engine step failed", extra={"model": self.name})
            outputs = self.engine.fail_all()
        took = time.perf_counter() - started
        own = bool(self._profiling)  # the profile's step (it runs alone): not in the metrics
        if (timed := self.engine.timed_steps()) is None:  # the step was one engine step
            if batch:
                self._measure(batch, took, newcomers(outputs), idle=own)
        else:  # what the streams timed of the server's steps read now: a sample of each kind
            for prefill in (False, True):
                if part := [(b, s) for b, s, p in timed if p is prefill]:
                    mean_batch = max(1, round(statistics.fmean(b for b, _ in part)))
                    self._measure(mean_batch, statistics.fmean(s for _, s in part), int(prefill), idle=own)
        after = self.engine.stats()
        if self._profiling:
            outputs = self._profile_outputs(outputs)
        if not own:
            self._count_batch(batch)
            self.on_step(StepRecord(batch, len(after.running), len(after.waiting), threads or 0), after)
        if outputs:
            self._post(outputs)

    # ---- the profile ------------------------------------------------------------------

    def _profile(self) -> None:
        """Before any real request: `n` greedy requests of a short prompt, decoding
        PROFILE_STEPS steps together (their end of sequence barred), for `n` of one and of
        every slot (that one cut short past PROFILE_FULL_BUDGET_S), timed as any step
        (`_measure`: the prefill step, at batch 0 before it, is not); their outputs are
        dropped (`_profile_outputs`). Then the requests held
        meanwhile go in, in their order. A profile that fails or outlasts
        PROFILE_TIMEOUT_S is given up (logged): the engine serves all the same."""
        started = time.monotonic()
        try:
            for n in (1, self.engine.max_batch_size):
                self._profile_batch(n)
                batch_started = time.monotonic()
                while self._profiling and not self._stop:
                    if time.monotonic() - started > PROFILE_TIMEOUT_S:
                        raise TimeoutError(f"not done after {PROFILE_TIMEOUT_S:g} s")
                    if (
                        time.monotonic() - batch_started > PROFILE_FULL_BUDGET_S
                        and len(self._full if n > 1 else self._alone_idle) >= PROFILE_MIN_FULL_STEPS
                    ):
                        self._end_profile_requests()  # enough steps to judge by
                        break
                    self._step(len(self.engine.stats().running))
                load = self.load()
                log.info(
                    "step profile: batch %d done; steps %s s at small batches (median batch %s), "
                    "%s s at near-full (%s)",
                    n,
                    None if load.step_s is None else round(load.step_s, 4),
                    load.small_batch,
                    None if load.full_step_s is None else round(load.full_step_s, 4),
                    load.full_batch,
                    extra={"model": self.name},
                )
        except Exception as exc:  # noqa: BLE001 - the engine must serve without its figures
            log.warning("step profile given up: %r", exc, extra={"model": self.name})
            self._end_profile_requests()
        self._release_held()
        self._probes_before = time.monotonic()  # the profile's steps: a probe's to rescale
        if self._figures is not None:
            self._keep_figures()

    def _release_held(self) -> None:
        """The requests and cancels held while the profile or a probe ran go in, in order."""
        with self._held_lock:
            for command in self._held:
                if isinstance(command, str):
                    self.engine.cancel(command)
                    continue
                try:
                    self.engine.add(command)
                except Exception as exc:  # noqa: BLE001 - as an engine process's add: it ends, the rest go in
                    log.warning("engine refused a request: %r", exc, extra={"request_id": command.request_id})
                    self._post([StepOutput.ended(command, "error")])
            self._held.clear()
            self._probing = False
            self.profiled.set()
        self._wake.set()

    # ---- the idle probes (consumers/inference/probes.py) -------------------------------

    def _idle(self) -> None:
        """Nothing to step: wait for a request, and probe when one is due (and the
        engine's layers are in place: the probe times the steps it will serve with)."""
        self._wake.wait(0.5)
        self._wake.clear()
        now = time.monotonic()
        self._pressure_now = self._pressure.read(now)
        if (
            self._probing_on
            and not self._stop
            and self._probes.due(now, self._idle_since, self._pressure_now)
            and self.engine.wait_packed(0)
        ):
            self._probe()

    def _probe(self) -> None:
        """Step one short synthetic request alone for a few decode steps (`_probed_enough`),
        as the profile's lone one (out of the outputs, the metrics and the prefix cache),
        and let the figures follow what they took (`_follow`). Requests that come meanwhile
        wait at most a step: the probe then ends, its steps unused under PROBE_STEPS."""
        with self._held_lock:
            if self.engine.stats().has_work():
                return
            self._probing = True
        self._probe_times = []
        started = time.monotonic()
        try:
            self._profile_batch(1, probes.PROBE_MAX_STEPS)
            while self._profiling and not self._held and not self._stop and not self._probed_enough():
                if time.monotonic() - started > PROBE_TIMEOUT_S:
                    raise TimeoutError(f"not done after {PROBE_TIMEOUT_S:g} s")
                self._step(len(self.engine.stats().running))
        except Exception as exc:  # noqa: BLE001 - a failed probe costs its figure, not the engine
            log.warning("step probe given up: %r", exc, extra={"model": self.name})
        finally:
            if self._profiling:
                self._end_profile_requests()
            times, self._probe_times = self._probe_times, None
            self._release_held()
        ratio = self._follow(times, started) if len(times) >= probes.PROBE_STEPS else 1.0
        self._probes.probed(time.monotonic(), self._pressure_now, faster=ratio < 1.0)
        if len(times) >= probes.PROBE_STEPS:
            self._post([])  # an engine process's stats go up with it (heartbeats carry them)

    def _probed_enough(self) -> bool:
        times = self._probe_times or []
        return len(times) >= probes.PROBE_MAX_STEPS or (
            len(times) >= probes.PROBE_STEPS and sum(times) >= probes.PROBE_MIN_S
        )

    def _follow(self, times: list[float], started: float) -> float:
        """A probe's lone step: past probes.RESCALE_AT from the figures' own lone steps,
        every step figure measured before the previous probe is rescaled by as much (those
        since are requests' own steps, measured as the machine is now); then it joins them.
        What it rescaled them by."""
        probe_s = statistics.median(times)
        lone = statistics.median(self._alone_idle) if self._alone_idle else None
        ratio = probes.rescaled(probe_s, lone)
        if ratio != 1.0:
            before = self._probes_before
            for name in self._TIMED:
                values, at = getattr(self, name), self._at[name]
                for i, t in enumerate(at):
                    if t < before:
                        values[i] *= ratio
            for i in range(len(self._alone_idle)):
                self._alone_idle[i] *= ratio
            log.info(
                "step probe: a step alone takes %.1f ms now, %.1f ms in the figures: they follow (x%.2f)",
                probe_s * 1000,
                (lone or 0.0) * 1000,
                ratio,
                extra={"model": self.name},
            )
        self._alone_idle.extend(times)
        self._probes_before = started
        self.measured_at = time.time()
        return ratio

    # ---- the figures kept between processes ---------------------------------------------

    _KEPT = ("_small", "_small_batches", "_full", "_full_batches", "_alone", "_alone_idle")
    _TIMED = ("_small", "_full", "_alone")  # the steps a probe rescales by when they ran

    def _keep_figures(self) -> None:
        """Write the measured steps to the figures file (atomically: a reader sees the old
        or the new); the write's time says how fresh they are."""
        assert self._figures is not None
        self._figures_saved = time.monotonic()
        kept: dict[str, object] = {name: list(getattr(self, name)) for name in self._KEPT}
        kept |= {"written_at": time.time(), "measured_at": self.measured_at, "pid": os.getpid()}
        try:
            self._figures.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._figures.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(kept))
            tmp.replace(self._figures)
        except OSError as exc:  # a read-only directory costs the next start its profile, nothing else
            log.warning("step figures not kept (tried once): %r", exc, extra={"model": self.name})
            self._figures = None

    def _take_figures(self) -> bool:
        """Seed the measured steps from the figures file if one was written within
        FIGURES_MAX_AGE_S with a full batch's steps in it: the profile is then skipped."""
        if self._figures is None:
            return False
        try:
            kept = json.loads(self._figures.read_text())
            age = time.time() - float(kept["written_at"])
            if age > FIGURES_MAX_AGE_S or len(kept["_full"]) < PROFILE_MIN_FULL_STEPS:
                return False
            seeds = {name: [(int if name.endswith("batches") else float)(x) for x in kept[name]] for name in self._KEPT}
        except (OSError, ValueError, KeyError, TypeError):
            return False
        for name, values in seeds.items():
            getattr(self, name).extend(values)
            if name in self._TIMED:
                self._at[name].extend([-math.inf] * len(values))
        self._probes_before = time.monotonic()  # the first probe rescales them all
        self.measured_at = float(kept.get("measured_at") or 0.0)
        log.info(
            "step profile skipped: the steps process %s measured (kept %.0f s ago) stand for it",
            kept.get("pid"),
            age,
            extra={"model": self.name},
        )
        return True

    def _end_profile_requests(self) -> None:
        """Cancel the profile's requests still running; their last outputs are dropped."""
        for rid in self._profiling:
            self.engine.cancel(rid)
        with suppress(Exception):
            self._profile_outputs(self.engine.step())
        self._profiling.clear()

    def _profile_batch(self, n: int, steps: int = PROFILE_STEPS) -> None:
        loaded = self.engine.loaded
        prompt = loaded.tokenizer.encode("Tell me about the weather in the mountains", add_special_tokens=False)
        params = SamplingParams(
            temperature=0,
            max_tokens=steps + 1,
            logit_bias=tuple((eos, -100.0) for eos in loaded.eos_ids),
        )
        ids = [f"{PROFILE_PREFIX}{n}-{i}-{time.monotonic_ns()}" for i in range(n)]
        self._profiling.update(ids)
        for rid in ids:
            self.engine.add(GenRequest(rid, prompt[:PROFILE_PROMPT_TOKENS], params, cache=False))

    def _profile_outputs(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """The step's outputs less the profile's (whose finished ones leave `_profiling`)."""
        mine = {o.request_id for o in outputs if o.request_id in self._profiling}
        if not mine:
            return outputs
        self._profiling -= {o.request_id for o in outputs if o.request_id in mine and o.finished}
        return [o for o in outputs if o.request_id not in mine]

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

    def _measure(self, batch: int, took: float, fresh: int = 0, idle: bool = False) -> None:
        """A step's time: a decode step's (no newcomer in it) at its batch; a step that
        prefilled `fresh` newcomers counts its time past a decode step's at that batch as
        prefill, for the share (`_prefill_share`). `idle`: the profile's own step."""
        if self._probe_times is not None:  # a probe's step: its own figure (`_probe`)
            if batch == 1 and not fresh:
                self._probe_times.append(took)
            return
        self.measured_at = time.time()
        prefill = 0.0
        if fresh:
            decode = decode_step(self._decode_figures(), batch)
            prefill = max(0.0, took - decode) if decode is not None else 0.0
        self._recent.append((time.monotonic(), took, prefill))
        if fresh:
            return
        now = time.monotonic()
        if batch * 2 >= self.engine.max_batch_size:
            self._full.append(took)
            self._full_batches.append(batch)
            self._at["_full"].append(now)
        else:
            self._small.append(took)
            self._small_batches.append(batch)
            self._at["_small"].append(now)
        if batch == 1 and idle:
            self._alone_idle.append(took)
        elif batch == 1:
            self._alone.append(took)
            self._at["_alone"].append(now)

    def _decode_figures(self) -> EngineLoad:
        """The decode steps measured, as a load carries them (at small and at near-full
        batches, of the last 64 each)."""
        small, full = self._small, self._full
        return EngineLoad(
            max_batch=self.engine.max_batch_size,
            step_s=typical_step(small) if small else None,
            full_step_s=typical_step(full) if full else None,
            full_batch=statistics.median_low(self._full_batches) if full else None,
            small_batch=statistics.median_low(self._small_batches) if small else None,
        )

    def _alone_step(self) -> float | None:
        """How fast a request goes alone: the median of the recent steps with one request
        in the batch (real prompts and answers, the stack's own work beside them), else,
        until MIN_SAMPLES of those ran, of the profile's lone request. The profile's is a
        lower bound (a short context, nothing streamed beside it: 51 ms for SmolLM2, whose
        256-token answer then stepped ~55 ms and ended at 15.04 s in the stack), so it is
        not preferred once the real ones are measured."""
        if len(self._alone) >= MIN_SAMPLES:
            return statistics.median(self._alone)
        # The profile's lone batch is cut short on a slow machine (PROFILE_FULL_BUDGET_S):
        # 4 steps then, and each probe adds its own.
        return statistics.median(self._alone_idle) if len(self._alone_idle) >= PROFILE_MIN_FULL_STEPS else None

    def _prefill_share(self) -> float:
        """Of the steps in the last PREFILL_WINDOW_S, the share of their time that went to
        newcomers' prefills: under arrivals, a request's decode steps are stretched by it
        (`runtime.steps.stretch`: new requests' prompts join its steps)."""
        since = time.monotonic() - PREFILL_WINDOW_S
        recent = [(took, prefill) for at, took, prefill in list(self._recent) if at >= since]
        busy = sum(took for took, _ in recent)
        return min(1.0, sum(p for _, p in recent) / busy) if busy > 0 else 0.0

    def _count_batch(self, batch: int) -> None:
        """A served step's batch, into its second's entry (the runner's thread)."""
        second = int(time.monotonic())
        if self._busiest and self._busiest[-1][0] == second:
            self._busiest[-1] = (second, max(batch, self._busiest[-1][1]))
        else:
            self._busiest.append((second, batch))

    def _recent_running(self) -> int:
        """The most requests a served step (not the profile's) ran in the last PEAK_WINDOW_S
        (to the second)."""
        since = time.monotonic() - PEAK_WINDOW_S
        return max((batch for second, batch in list(self._busiest) if second + 1 > since), default=0)

    def finish_at(self, tokens: int) -> float | None:
        """When a request joining now would end, at worst (:func:`estimate_finish`)."""
        return estimate_finish(self.stats(), self.engine.max_batch_size, tokens)

    def stats(self) -> SchedulerStats:
        """The engine's queue, its load and the steps measured (at small and at near-full
        batches, of the last 64 each)."""
        queue = self.engine.stats()
        load = self._decode_figures().model_copy(
            update={
                "running": len(queue.running),
                "waiting": len(queue.waiting),
                "alone_step_s": self._alone_step(),
                "prefill_share": self._prefill_share(),
                "recent_running": self._recent_running(),
                "ends": tuple(sorted(queue.running)),
                "measured_at": self.measured_at,
            }
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
