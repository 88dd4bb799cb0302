"""A circuit breaker for an upstream server: after repeated failures it opens (the model's
requests are refused at once, the heartbeat marks it unavailable, the arena stops pairing
it); after a cooldown it lets one request through (half-open), which closes it again or
opens it for twice as long."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Failures in a row (no success between) that open the circuit.
FAILURES_TO_OPEN = 5
#: How long it stays open the first time; each failed probe doubles it, up to the most.
COOLDOWN_S = 5.0
MAX_COOLDOWN_S = 60.0


class Circuit:
    """Closed, open or half-open, by the outcomes it is told; thread-safe."""

    def __init__(
        self,
        failures_to_open: int = FAILURES_TO_OPEN,
        cooldown_s: float = COOLDOWN_S,
        max_cooldown_s: float = MAX_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures_to_open, self.cooldown_s, self.max_cooldown_s = failures_to_open, cooldown_s, max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None  # None: closed
        self._cooldown = cooldown_s
        self._probing = False
        self.last_failure = ""

    @property
    def open(self) -> bool:
        """Open or half-open: not known to answer (the heartbeat says so)."""
        return self._opened_at is not None

    def allow(self) -> bool:
        """Whether a request may go to the upstream now: closed, or the half-open probe."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._probing or self._clock() - self._opened_at < self._cooldown:
                return False
            self._probing = True
            return True

    def retry_in(self) -> float:
        """Seconds until the next probe may go (0 when closed)."""
        if self._opened_at is None:
            return 0.0
        return max(0.0, self._opened_at + self._cooldown - self._clock())

    def succeeded(self) -> None:
        with self._lock:
            self._failures, self._opened_at, self._probing, self._cooldown = 0, None, False, self.cooldown_s

    def failed(self, why: str) -> None:
        with self._lock:
            self.last_failure = why
            self._failures += 1
            if self._probing:  # the probe failed: open again, for longer
                self._probing = False
                self._opened_at = self._clock()
                self._cooldown = min(self.max_cooldown_s, self._cooldown * 2)
            elif self._opened_at is None and self._failures >= self.failures_to_open:
                self._opened_at = self._clock()

    def released(self) -> None:
        """The probe ended without saying either way (cancelled, its deadline): another may go."""
        with self._lock:
            self._probing = False
