"""Decode step time at a batch size, from the step times measured at a small and at a
near-full batch: the one model the gateway's admission and the inference worker's own
too-late check both use (pure)."""

from __future__ import annotations


def step_time(small: float | None, full: float | None, full_batch: int | None, slots: int, batch: int) -> float | None:
    """Linear from the small-batch time (at 1) through the near-full one (at `full_batch`,
    the batch it was measured at, else all the `slots`), extrapolated beyond it: a burst
    fills batches no steady load reached. None when nothing was measured."""
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
    share = max(0.0, (min(batch, slots) - 1) / (at - 1))
    return max(small, small + (full - small) * share)
