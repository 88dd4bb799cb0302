"""A runner's step figures between processes and over time: kept in a file (an engine of
the same model starting soon after takes them instead of profiling), and followed by
the idle probes (a probe's lone step far from the figures' rescales them)."""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

from consumers.inference.runners import probes
from consumers.inference.runners.figures import FIGURES_EVERY_S, StepFigures

log = logging.getLogger(__name__)


class KeptFigures:
    """``figures`` kept in the file ``path`` (None: not kept), every FIGURES_EVERY_S."""

    def __init__(self, figures: StepFigures, path: str | None, name: str) -> None:
        self.figures = figures
        self.path = Path(path) if path else None
        self.name = name
        self.saved = 0.0

    def due(self, now: float) -> bool:
        return self.path is not None and now - self.saved >= FIGURES_EVERY_S

    def keep(self) -> None:
        """Write the figures to their file (a read-only directory costs the next start its
        profile, nothing else: tried once)."""
        if self.path is None:
            return
        self.saved = time.monotonic()
        try:
            self.figures.keep(self.path)
        except OSError as exc:
            log.warning("step figures not kept (tried once): %r", exc, extra={"model": self.name})
            self.path = None

    def take(self, min_full_steps: int) -> bool:
        """Seed the figures from their file when fresh (`StepFigures.take`): the profile is
        then skipped, and the first probe rescales them to the machine as it is now."""
        taken = self.figures.take(self.path, min_full_steps) if self.path is not None else None
        if taken is None:
            return False
        log.info(
            "step profile skipped: the steps process %s measured (kept %.0f s ago) stand for it "
            "once a probe confirms them",
            taken[1],
            taken[0],
            extra={"model": self.name},
        )
        return True


def probed_enough(times: list[float]) -> bool:
    """Whether a probe's lone steps are enough to judge by."""
    return len(times) >= probes.PROBE_MAX_STEPS or (
        len(times) >= probes.PROBE_STEPS and sum(times) >= probes.PROBE_MIN_S
    )


def follow(figures: StepFigures, times: list[float], started: float, name: str) -> float:
    """A probe's lone steps (``times``, from ``started``): past probes.RESCALE_AT from the
    figures' own lone steps, every step figure measured before the previous probe is
    rescaled by as much (those since are requests' own steps, measured as the machine is
    now); then they join them. What it rescaled them by."""
    probe_s = statistics.median(times)
    lone = statistics.median(figures.alone_idle) if figures.alone_idle else None
    ratio = probes.rescaled(probe_s, lone)
    if ratio != 1.0:
        figures.rescale(ratio)
        log.info(
            "step probe: a step alone takes %.1f ms now, %.1f ms in the figures: they follow (x%.2f)",
            probe_s * 1000,
            (lone or 0.0) * 1000,
            ratio,
            extra={"model": name},
        )
    figures.alone_idle.extend(times)
    figures.probes_before = started
    figures.measured_at = time.time()
    return ratio
