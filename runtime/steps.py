"""Decode step time at a batch size, from the step times measured at a small and at a
near-full batch: the one model the gateway's admission and the inference worker's own
too-late check both use (pure)."""

from __future__ import annotations

#: The full step's figure is the median batch's of recent steps, and a steady load's
#: batch moves around it: up to this much beyond it, a step is taken as measured.
MEASURED_SPREAD = 1.1


def step_time(small: float | None, full: float | None, full_batch: int | None, slots: int, batch: int) -> float | None:
    """Linear from the small-batch time (at 1) through the near-full one (at `full_batch`,
    the batch it was measured at, else all the `slots`), extrapolated beyond it; and,
    further than MEASURED_SPREAD beyond it, at least in proportion to the batch: a burst
    fills batches no steady load reached. None when nothing was measured.

    On hardware whose steps hardly grow with the batch (a GPU's decode), the proportional
    bound refuses more of a burst than needed only until its own steps are measured
    (heartbeats, every second)."""
    small = small if small is not None else full
    full = full if full is not None else small
    if small is None or full is None:
        return None
    # A bigger batch never steps faster: small batches, measured while a load ramps up or
    # drains, are mostly steps with a prompt's prefill in them, and their median can come
    # out above the full batches' (30 ms against 13 ms seen in one burst's heartbeat,
    # which then refused half of what the fleet served in time in the next).
    small = min(small, full)
    at = full_batch if full_batch and full_batch > 1 else max(2, slots)
    batch = min(batch, slots)
    line = max(small, small + (full - small) * (batch - 1) / (at - 1))
    # The line's slope comes from that prefill-heavy small-batch figure, so it is low:
    # flat from 12.4 ms at the small batches to 12.0 at 48, a burst filling 64 slots was
    # judged at 12 ms a step and ran at ~18, and test_overload's two gateways let 320 to
    # 400 requests through, answered at up to 15 s. Proportional growth is an upper bound
    # (a step's fixed part does not grow); it starts past the spread of the measured batch
    # (from the batch itself, one more row refused 10 % of a 16-user llama-60m load that
    # finished at P99 9.5 s of its 15).
    return max(line, full * batch / (at * MEASURED_SPREAD))
