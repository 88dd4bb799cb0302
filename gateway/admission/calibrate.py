"""How far the deadline estimate is off, learned from the requests it admitted (pure).

The estimate (`estimate.py`) multiplies the workers' measured step times by a margin: a
request admitted now shares its steps with the requests admitted after it, so its steps
grow past what was measured when it was judged. A fixed margin is wrong both ways: 1.5
refused all but one of a 400-request burst that llama.cpp's server answered 32 of in
time (SmolLM2, `python -m bench.admission`), and on a fleet whose batches grow faster
it would let requests in to miss their deadline.

So the margin is learned per model. For every request admitted with an estimate and
then answered (or ended at its deadline), the margin it would have needed is

    needed = (took_s - overhead_s) / (wait_s + tokens * step_s)

with `wait_s` as estimated (margin aside), `step_s` the step the figures it was judged
by give at the batch it shared over its life (`LivedBatches`), `tokens` the tokens it really
generated (a budget is an upper bound: an early stop is no error of the estimate) and
`took_s` from admission to its end; a request the deadline cut records what its tokens
made so far needed (more than the margin it had; CEILING when it made none). The
margin admission uses is the 99th percentile of the last WINDOW of those (of 200, the
second highest: two misses in the window and it is the most there is), within [FLOOR,
CEILING], of those learned in the last minute (LESSONS_KEEP_S) where MIN_SAMPLES were.
Only requests whose estimated work was at least NEAR_EDGE of their deadline (and
MIN_WORK_S) are counted there: the margin decides only near the edge. Until MIN_SAMPLES
of those were seen, and once fewer are that recent, the configured one
(`ARENA_ADMISSION_MARGIN`), or less where the older lessons say less.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.metrics import METRICS

WINDOW = 200
MIN_SAMPLES = 20
#: A margin under 1 is what an estimate that says too much learns: at llama-server's
#: knee (2.5-3 requests/s, the llama.cpp backend) the turns near the edge needed 0.86-0.90
#: at the median and the quantile sat at a floor of 1, while turns estimated at 15-17 s
#: were refused that took 12-14 (bare llama-server answered every one by 12.7 s).
FLOOR, CEILING = 0.75, 3.0
MIN_WORK_S = 1.0
#: Near the edge: estimated work (times the margin it was admitted with) at least this
#: share of the deadline. The estimate's error depends on how far from the edge it was
#: made: at 2-4.5 requests/s on llama.cpp (SmolLM2), the turns admitted at 40-60 % of the
#: deadline needed up to 1.21, those at 70-100 % at most 1.08 (median 0.86-0.90); counted
#: from 40 %, a margin learned at 2 requests/s (1.61-1.78, every turn answered by 7 s)
#: then refused at 3 requests/s turns the server answered by 11 s.
NEAR_EDGE = 0.7
QUANTILE = 0.99
#: Lessons older than this hold a margin up no longer (`Calibration`): four turns cut at
#: 6 requests/s on the llama.cpp backend with no token (each the CEILING), and the
#: margin stayed at 3 through the 9 requests/s that followed, since a margin of 3 admits
#: few turns near the edge and it took 197 new lessons to push them out of the window:
#: 1.10 turns/s in time where 2.2 had been answered.
LESSONS_KEEP_S = 60.0


@dataclass(frozen=True)
class Judged:
    """What a request was admitted with: the estimate's parts, margin aside."""

    wait_s: float
    step_s: float
    margin: float = 1.0  # the margin it was admitted with
    #: The step its figures then gave at a batch (stretched, margin aside): `needed` reads
    #: it at the batch it really shared (None: `step_s` is all there is).
    line: Callable[[float], float | None] | None = field(default=None, compare=False, repr=False)

    def needed(
        self,
        took_s: float,
        tokens: int,
        overhead_s: float,
        budget_s: float,
        cut: bool = False,
        shared_batch: float | None = None,
    ) -> float | None:
        """The margin this request needed; None when it says nothing of the margin: its
        estimated work under NEAR_EDGE of its deadline (`budget_s`), where a margin
        changes no verdict and the estimate errs otherwise than where it does (a
        64-token answer at 8 users needed 0.9 where a 256-token one beside it needed
        1.15: the steps a request lives through grow with its life; NEAR_EDGE).
        `shared_batch`: the batch it really shared (the time-weighted mean over its life
        of the requests running: `LivedBatches`): its step is read there off the figures
        it was judged by (`line`), in place of the batch it was judged at, so the margin
        is what its estimate was off by at the batch it really shared: how far the
        machine's speed moved after it was judged, not how the load did. Against the
        batch it was judged at, the first requests of a burst (judged beside a few,
        sharing their steps with the whole burst after) needed up to 1.43x, and a margin
        learned from them refused at saturation turns the server answered in time; against
        the figures of its end (as a first try read them), a machine slowing
        after turns were admitted taught nothing, and turns admitted near the edge were
        answered after it (8 at 6 requests/s on the built-in engine).
        Near the edge as it was judged: its work times the margin it was admitted with
        (a margin of 3 admits work of 5 s at most for a 15 s deadline, a third of it:
        judged without the margin, nothing would be recorded once the margin
        reached 1.4, and a margin pushed there by two cut turns stayed there for good,
        answering 1.2-1.7 turns/s where 2.7 were answered before).
        `cut`: the deadline ended it after `tokens`: how long those took says how far off
        the figures were (more than the margin it had), near the edge or not; CEILING
        when it made none."""
        step = self.line(shared_batch) if self.line is not None and shared_batch is not None else None
        step = self.step_s if step is None else step
        work = self.wait_s + tokens * step
        if cut:
            return CEILING if tokens <= 0 or work <= 0 else max(0.0, took_s - overhead_s) / work
        if work * self.margin < max(MIN_WORK_S, NEAR_EDGE * (budget_s - overhead_s)) or tokens <= 0:
            return None
        return max(0.0, took_s - overhead_s) / work


class Calibration:
    """The margins learned per model (see the module doc). ``clock``: seconds, for the
    lessons' age (`LESSONS_KEEP_S`)."""

    def __init__(
        self,
        configured: float,
        window: int = WINDOW,
        keep_s: float = LESSONS_KEEP_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.configured = configured
        self.window = window
        self.keep_s = keep_s
        self.clock = clock
        #: Each model's lessons: (when, the margin a request needed), oldest first.
        self.needed: dict[str, deque[tuple[float, float]]] = {}
        #: Each model's margin, worked out when a request ends (`record`) and when its
        #: oldest lesson ages (`margin`, at most every second), read by every request
        #: judged, which far outnumber them.
        self.margins: dict[str, float] = {}
        self._settled: dict[str, float] = {}

    def record(self, model: str, needed: float | None) -> None:
        if needed is None:
            return
        self.needed.setdefault(model, deque(maxlen=self.window)).append((self.clock(), needed))
        self._settle(model)

    def _settle(self, model: str) -> None:
        """The model's margin from its lessons: the QUANTILE of those of the last LESSONS_KEEP_S
        where MIN_SAMPLES are that recent; else the configured margin, or less where the
        window's lessons, older ones too, say less (old lessons may keep a margin low,
        never hold it up)."""
        now = self._settled[model] = self.clock()
        lessons = self.needed.get(model) or ()
        recent = [needed for at, needed in lessons if at >= now - self.keep_s]
        if len(recent) >= MIN_SAMPLES:
            self.margins[model] = _quantile(recent)
        elif len(lessons) >= MIN_SAMPLES:
            self.margins[model] = min(self.configured, _quantile([needed for _, needed in lessons]))
        METRICS.admission_margin.labels(model).set(self.margins.get(model, self.configured))

    def margin(self, model: str) -> float:
        seen = self.needed.get(model)
        if seen and (now := self.clock()) - self._settled.get(model, now) >= 1.0 and seen[0][0] < now - self.keep_s:
            self._settle(model)
        return self.margins.get(model, self.configured)


def _quantile(needed: list[float]) -> float:
    ordered = sorted(needed)
    return min(CEILING, max(FLOOR, ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]))


#: How often a model's running batch is sampled (`LivedBatches`), at most, and how long
#: kept: a request lives up to its deadline (the longest a client may ask is 120 s).
SAMPLE_EVERY_S = 0.5
KEEP_S = 150.0


@dataclass
class LivedBatches:
    """The batch each model's workers ran, over the last KEEP_S: what a request that ends
    now shared, on average over its own life (`mean`), for `Judged.needed`. Sampled at
    each request judged and ended (SAMPLE_EVERY_S at most), from the heartbeats' running
    requests."""

    samples: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)

    def due(self, model: str, now: float) -> bool:
        seen = self.samples.get(model)
        return not seen or now - seen[-1][0] >= SAMPLE_EVERY_S

    def add(self, model: str, now: float, batch: float) -> None:
        seen = self.samples.setdefault(model, deque())
        seen.append((now, batch))
        while seen and seen[0][0] < now - KEEP_S:
            seen.popleft()

    def mean(self, model: str, since: float, now: float) -> float | None:
        """The time-weighted mean over [since, now], each sample holding until the next
        (the one before `since` from `since`); None without a sample."""
        seen = list(self.samples.get(model) or ())
        if not seen:
            return None
        start = max(0, bisect.bisect_right([t for t, _ in seen], since) - 1)
        lived = seen[start:]
        total = covered = 0.0
        for i, (at, value) in enumerate(lived):
            until = lived[i + 1][0] if i + 1 < len(lived) else now
            span = max(0.0, min(until, now) - max(at, since))
            total, covered = total + value * span, covered + span
        return total / covered if covered > 0 else lived[-1][1]
