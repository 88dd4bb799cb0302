"""When an idle engine re-measures its step alone, and what the new figure does to the
old ones (pure, but for reading the CPU's pressure).

The step figures a worker's heartbeats carry decide admission: the step alone is the
400 `deadline_too_short` (too long even with nothing else to run), the others the 429s.
Measured once, they stay what the machine was then: a start-up profile run beside a CPU
hog said a SmolLM2 token took 2,172 ms where it took ~95 once the hog ended, and the
README's first request was refused for minutes, since a refused request runs nothing
and nothing else measured. So an idle engine times a short synthetic request alone now
and then (`EngineRunner._probe`), often while the CPU is contended or its contention
changed (the hog may end at any moment), rarely on a quiet machine; and a probe that
finds the steps alone `RESCALE_AT` faster or slower than the figures' own lone steps
rescales every figure by as much (`rescaled`): contention slows a step of any batch
alike (the engine gets its share of the cores), so the figures measured at every batch
follow the machine as it is now, not only the step alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from pathlib import Path

#: Decode steps a probe times, after its prefill step: at least PROBE_STEPS, and on until
#: they took PROBE_MIN_S or PROBE_MAX_STEPS ran; its figure is their median, as the step
#: alone's (a probe that the hog's end cut in two is the machine after it, where a mean
#: was neither). Beside a hog one SmolLM2 step took 0.1 to 2 s, and a stories-260k step
#: of 1 ms took 17 when a neighbour woke: one or two steps say nothing.
PROBE_STEPS = 3
PROBE_MIN_S = 0.25
PROBE_MAX_STEPS = 16
#: A probe waits for this long without a request (a conversation's next turn soon after
#: the last one does not wait behind one).
IDLE_S = 1.0
#: How often an idle engine probes while the CPU is contended or its contention changed
#: since the last probe (the reaction time to a hog's end, but for the probe itself).
EVERY_S = 2.0
#: ... and on a quiet machine whose contention did not change.
QUIET_EVERY_S = 60.0
#: Pressure (the share of time some runnable task waited for a core) from which the CPU
#: counts as contended, and the change since the last probe that calls for another one.
CONTENDED = 0.2
CHANGED = 0.2
#: A probe this many times faster or slower than the figures' own lone steps rescales
#: them all; nearer, its steps only join the lone ones (a probe's noise moves nothing).
RESCALE_AT = 1.25

#: Linux's pressure stall information for the CPU: the cgroup's (a container's own
#: quota and neighbours), else the machine's.
PSI_FILES = ("/sys/fs/cgroup/cpu.pressure", "/proc/pressure/cpu")


class Pressure:
    """The CPU's contention over the interval since the last `read`: the share of it in
    which some runnable task waited for a core (the ``some`` line's ``total``, in µs).
    None where the kernel does not say (no PSI): the engine then probes as if contended."""

    def __init__(self, files: Iterable[str] = PSI_FILES) -> None:
        self.path = next((Path(f) for f in files if _stalled_us(Path(f)) is not None), None)
        self._last: tuple[float, int] | None = None

    def read(self, now: float | None = None) -> float | None:
        if self.path is None or (stalled := _stalled_us(self.path)) is None:
            return None
        now = time.monotonic() if now is None else now
        last, self._last = self._last, (now, stalled)
        if last is None or now <= last[0]:
            return None
        return min(1.0, (stalled - last[1]) / 1e6 / (now - last[0]))


def _stalled_us(path: Path) -> int | None:
    try:
        line = path.read_text().splitlines()[0]  # "some avg10=.. avg60=.. avg300=.. total=N"
        return int(line.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


class ProbeClock:
    """When an idle engine probes: after `IDLE_S` without a step, every `EVERY_S` while
    the CPU is contended (or the pressure is unknown) or its pressure moved by `CHANGED`
    since the last probe, else every `QUIET_EVERY_S`. Due at once when nothing was
    measured yet in this process (figures kept by an earlier one: `figures.FIGURES_MAX_AGE_S`)
    and after a probe that found the machine faster than the figures."""

    def __init__(self) -> None:
        self.probed_at = -math.inf
        self.pressure_at: float | None = None
        self.moved = False

    def due(self, now: float, idle_since: float, pressure: float | None) -> bool:
        if now - idle_since < IDLE_S:
            return False
        if self.moved:
            return True
        since = now - self.probed_at
        if since >= QUIET_EVERY_S:
            return True
        if since < EVERY_S:
            return False
        if pressure is None or self.pressure_at is None or pressure >= CONTENDED:
            return True
        return abs(pressure - self.pressure_at) >= CHANGED

    def probed(self, now: float, pressure: float | None, faster: bool = False) -> None:
        """A probe ended; one that found the machine `faster` than the figures calls for
        the next as soon as the engine is idle: a hog's end leaves other work running
        down, and SmolLM2's probes then said 2,612, 1,358, 945, then 134 ms a step, each
        after its own slow steps and the 2 s between, while the figures refused requests.
        Not after a slower one: noise (a neighbour waking) mostly slows a step, and
        chasing it would probe without end."""
        self.probed_at, self.pressure_at, self.moved = now, pressure, faster


def rescaled(probe_s: float, lone_s: float | None) -> float:
    """What every figure is multiplied by after a probe that stepped alone in `probe_s`
    where the figures' own lone steps (the profile's and earlier probes', the same kind
    of step) took `lone_s`: their ratio when it is past `RESCALE_AT` either way, else 1."""
    if not lone_s or probe_s <= 0:
        return 1.0
    ratio = probe_s / lone_s
    return ratio if ratio >= RESCALE_AT or ratio <= 1 / RESCALE_AT else 1.0
