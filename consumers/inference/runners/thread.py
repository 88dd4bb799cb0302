"""Running a BatchEngine on its own thread, so the event loop never blocks on torch."""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable

from consumers.inference.engine.scheduler import BatchHold
from consumers.inference.engine_io import (
    EngineBackend,
    EngineStats,
    GenRequest,
    SchedulerStats,
    StepOutput,
    StepRecord,
)
from consumers.inference.metrics import METRICS, PrefixCounts
from consumers.inference.model_loading import LoadedModel
from consumers.inference.runners import probes
from consumers.inference.runners.figures import MIN_SAMPLES, StepFigures, estimate_finish
from consumers.inference.runners.handoff import Handoff
from consumers.inference.runners.kept import KeptFigures, follow, probed_enough
from consumers.inference.runners.synthetic import SyntheticRequests
from events.fleet import EngineLoad

log = logging.getLogger(__name__)

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
#: An idle engine's probe (`EngineRunner._probe`, consumers/inference/runners/probes.py) is given
#: up past this, its figure unused (a probe is a few steps: this is a stuck engine).
PROBE_TIMEOUT_S = 30.0


def newcomers(outputs: list[StepOutput]) -> int:
    """Requests whose first tokens a step's outputs carry: those it prefilled."""
    return sum(1 for o in outputs if o.new_token_ids and o.completion_tokens == len(o.new_token_ids))


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
    sets them (cores.py). ``available()``: False while the engine refuses every request
    (an upstream's open circuit; default: always available).
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
        available: Callable[[], bool] | None = None,
        idle_probes: bool = True,
        neighbours_stepping: Callable[[], bool] | None = None,
    ):
        self.engine = engine
        self._available = available
        self.before_step = before_step
        #: Whether another engine of the machine is stepping now (`cores.CoreShare`): an
        #: idle engine does not probe then (`_idle`).
        self.neighbours_stepping = neighbours_stepping
        self.max_wait_s = max_wait_s
        self._hold = BatchHold(max_wait_s, engine.max_batch_size)
        self.loop = loop
        self.on_outputs = on_outputs
        self._handoff = Handoff(loop, on_outputs)  # outputs on their way to the loop
        self.name = engine.loaded.spec.name
        self.prefix_counts = PrefixCounts(self.name)
        self.on_step = on_step or self._record
        self._wake = threading.Event()
        self._stop = False
        self.figures = StepFigures(engine.max_batch_size)
        #: The idle probes (`_probe`): when the next is due, the CPU's pressure, the probe's
        #: step times while it runs, and when the engine last stepped for a request.
        self._probes = probes.ProbeClock()
        self._pressure = probes.Pressure()
        self._pressure_now: float | None = None
        self._probe_times: list[float] | None = None
        self._probing = False
        self._idle_since = -math.inf
        #: Set once the profile has ended (at once without one); until then real requests
        #: and cancels wait in `_held`, in their order. The profile's requests in the engine.
        self.profiled = threading.Event()
        self._held: list[GenRequest | str] = []
        self._held_lock = threading.Lock()
        self._profiling = SyntheticRequests(PROFILE_PREFIX, PROFILE_PROMPT_TOKENS)
        self._kept = KeptFigures(self.figures, figures, self.name)  # the file the figures are kept in
        self._probing_on = profile and idle_probes  # the idle probes follow the profile's figures
        #: Figures taken from a file: a probe confirms (or rescales) them before any request.
        self._confirm = False
        if not profile:
            self.profiled.set()
        elif self._kept.take(PROFILE_MIN_FULL_STEPS):
            self._confirm = True
        else:
            self._probes.probed(time.monotonic(), None)  # the profile measures now
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    @property
    def loaded(self) -> LoadedModel:
        return self.engine.loaded

    def wait_ready(self, timeout: float) -> bool:
        """Ready once its profile ended (a llama-server's waits for it to come up)."""
        return self.profiled.wait(timeout)

    def available(self) -> bool:
        return self._available() if self._available is not None else True

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

    def _run(self) -> None:
        if not self.profiled.is_set():
            self.engine.wait_packed(PROFILE_TIMEOUT_S)  # the profile times the steps it will serve with
            if self._confirm:  # kept figures: one probe, to the end, before they judge a request
                self._probe(give_way=False)
            else:
                self._profile()
        while not self._stop:
            if self._kept.due(time.monotonic()):
                self._kept.keep()
            queue = self.engine.stats()
            if not queue.has_work():
                self._idle()
                continue
            hold = self._hold.seconds(len(queue.running), len(queue.waiting))
            if hold > 0:
                self._wake.wait(hold)
                self._wake.clear()
                continue
            self._hold.reset()
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
            outputs = self._profiling.strip(outputs)
        if not own:
            self.figures.count_batch(batch, took)
            self.on_step(StepRecord(batch, len(after.running), len(after.waiting), threads or 0), after)
        if outputs:
            self._post(outputs)

    # ---- the profile ------------------------------------------------------------------

    def _profile(self) -> None:
        """Before any real request: `n` greedy requests of a short prompt, decoding
        PROFILE_STEPS steps together (their end of sequence barred), for `n` of one and of
        every slot (that one cut short past PROFILE_FULL_BUDGET_S), timed as any step
        (`_measure`: the prefill step, at batch 0 before it, is not); their outputs are
        dropped (`SyntheticRequests.strip`). Then the requests held
        meanwhile go in, in their order. A profile that fails or outlasts
        PROFILE_TIMEOUT_S is given up (logged): the engine serves all the same."""
        started = time.monotonic()
        try:
            for n in (1, self.engine.max_batch_size):
                self._profiling.add(self.engine, n, PROFILE_STEPS)
                batch_started = time.monotonic()
                while self._profiling and not self._stop:
                    if time.monotonic() - started > PROFILE_TIMEOUT_S:
                        raise TimeoutError(f"not done after {PROFILE_TIMEOUT_S:g} s")
                    if (
                        time.monotonic() - batch_started > PROFILE_FULL_BUDGET_S
                        and len(self.figures.full if n > 1 else self.figures.alone_idle) >= PROFILE_MIN_FULL_STEPS
                    ):
                        self._profiling.end(self.engine)  # enough steps to judge by
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
            self._profiling.end(self.engine)
        self._release_held()
        self.figures.probes_before = time.monotonic()  # the profile's steps: a probe's to rescale
        self._kept.keep()

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

    # ---- the idle probes (consumers/inference/runners/probes.py) -------------------------------

    def _idle(self) -> None:
        """Nothing to step: wait for a request, and probe when one is due (and the
        engine's layers are in place: the probe times the steps it will serve with), but
        not while another engine of the machine steps: the probe would time that engine's
        load, not the machine's, and take its threads (`cores.CoreShare`: an engine
        stepping beside another runs on its shared threads). An idle stories-260k beside
        SmolLM2 serving 9 requests/s probed every 2 s, rescaling its figures by 0.24-4.6x
        each time, and halved SmolLM2's threads for each of its probes."""
        self._wake.wait(0.5)
        self._wake.clear()
        now = time.monotonic()
        self._pressure_now = self._pressure.read(now)
        if (
            self._probing_on
            and not self._stop
            and self._probes.due(now, self._idle_since, self._pressure_now)
            and not (self.neighbours_stepping is not None and self.neighbours_stepping())
            and self.engine.wait_packed(0)
        ):
            self._probe()

    def _probe(self, give_way: bool = True) -> None:
        """Step one short synthetic request alone for a few decode steps (`kept.probed_enough`),
        as the profile's lone one (out of the outputs, the metrics and the prefix cache),
        and let the figures follow what they took (`kept.follow`). Requests that come meanwhile
        wait at most a step: the probe then ends, its steps unused under PROBE_STEPS. At
        start (`give_way` False) the probe confirms figures kept by an earlier process: it
        runs to its end while requests wait, as they wait for a profile, since a figure
        measured on a machine busy then (a hog, a build) refused what it now answers."""
        with self._held_lock:
            if self.engine.stats().has_work():
                return
            self._probing = True
        self._probe_times = []
        started = time.monotonic()
        try:
            self._profiling.add(self.engine, 1, probes.PROBE_MAX_STEPS)
            while (
                self._profiling
                and not (give_way and self._held)
                and not self._stop
                and not probed_enough(self._probe_times or [])
            ):
                if time.monotonic() - started > PROBE_TIMEOUT_S:
                    raise TimeoutError(f"not done after {PROBE_TIMEOUT_S:g} s")
                self._step(len(self.engine.stats().running))
        except Exception as exc:  # noqa: BLE001 - a failed probe costs its figure, not the engine
            log.warning("step probe given up: %r", exc, extra={"model": self.name})
        finally:
            if self._profiling:
                self._profiling.end(self.engine)
            times, self._probe_times = self._probe_times, None
            self._release_held()
        ratio = follow(self.figures, times, started, self.name) if len(times) >= probes.PROBE_STEPS else 1.0
        self._probes.probed(time.monotonic(), self._pressure_now, faster=ratio < 1.0)
        if len(times) >= probes.PROBE_STEPS:
            self._post([])  # an engine process's stats go up with it (heartbeats carry them)

    def _record(self, step: StepRecord, stats: EngineStats) -> None:
        """The default ``on_step``: the step and the prefix cache's counts in this process's metrics."""
        record_step(self.name, step)
        self.prefix_counts.update(stats.prefix)

    def _post(self, outputs: list[StepOutput]) -> None:
        self._handoff.post(outputs)

    def _measure(self, batch: int, took: float, fresh: int = 0, idle: bool = False) -> None:
        """A step's time into the figures (`StepFigures.measure`); a probe's into its own."""
        if self._probe_times is not None:  # a probe's step: its own figure (`_probe`)
            if batch == 1 and not fresh:
                self._probe_times.append(took)
            return
        self.figures.measure(batch, took, fresh, idle)

    def finish_at(self, tokens: int) -> float | None:
        """When a request joining now would end, at worst (:func:`estimate_finish`)."""
        return estimate_finish(self.stats(), self.engine.max_batch_size, tokens)

    def stats(self) -> SchedulerStats:
        """The engine's queue, its load and the steps measured (at small and at near-full
        batches, of the last 64 each)."""
        return self.figures.stats(self.engine.stats(), PROFILE_MIN_FULL_STEPS)

    def load(self) -> EngineLoad:
        """What this engine holds and how fast it steps (for heartbeats)."""
        return self.stats().load

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.engine.close()
