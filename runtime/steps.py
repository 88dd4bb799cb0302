"""A request's step time: the decode step at a batch size, from the decode steps measured
at a small and at a near-full batch, stretched by the share of recent step time that
newcomers' prefills took: the one model the gateway's admission and the inference
worker's own too-late check both use (pure)."""

from __future__ import annotations

import math

#: The window a worker's share of step time spent on newcomers' prefills is measured over
#: (`EngineLoad.prefill_share`): a few arrivals long, and a load's prefills stop counting
#: this soon after the load ends (a burst after conversations is not judged by their
#: histories' prefills).
PREFILL_WINDOW_S = 5.0
#: The most of it taken: a request's decode steps are counted at most 3x.
MAX_PREFILL_SHARE = 2 / 3
#: The window of the busiest batch a worker reports (`EngineLoad.recent_running`): the
#: default deadline, the most a request admitted now lives through. Users in conversation
#: idle between turns, so the batch of the moment a turn arrives is often below the one
#: its tokens will share: 8 users' 256-token turns, judged at the batch of the moment,
#: were admitted to miss their deadline (3 of 11 with the llama.cpp backend).
PEAK_WINDOW_S = 15.0


def stretch(prefill_share: float, measured_at: float, now: float) -> float:
    """How much newcomers' prefills stretch a request's decode steps while others arrive
    beside it: 1 / (1 - share), the share at most MAX_PREFILL_SHARE; 1 once the share is
    older than its window (no step since: no one arrived, whatever the last figure said)."""
    if now - measured_at > PREFILL_WINDOW_S:
        return 1.0
    return 1 / (1 - min(prefill_share, MAX_PREFILL_SHARE))


def step_time(
    small: float | None,
    full: float | None,
    full_batch: int | None,
    slots: int,
    batch: float,
    small_batch: int | None = None,
) -> float | None:
    """Decode step time (newcomers' prefills apart: `stretch`): linear from the small-batch
    time (at `small_batch`, the batch it was measured at, else 1; that time below it) to
    the near-full one (at `full_batch`, the batch it was measured at, else
    all the `slots`), and in proportion to the batch beyond it: a burst fills batches no
    steady load reached. None when nothing was measured.
    On hardware whose steps hardly grow with the batch (a GPU's decode), this refuses more
    of a burst than needed only until its own steps are measured (heartbeats, every second)."""
    if full is None and small is not None and small_batch:
        # Only small batches measured (a fresh stack, a load that never filled half the
        # slots): beyond the batch they ran at (their median), a step grows in proportion,
        # as beyond the full one. Taken flat, llama.cpp's steps at 1-4 requests (35 ms)
        # judged a first wave of 32 (150 ms a step): 18 of 110 turns admitted and missed.
        return small * min(batch, slots) / small_batch if batch > small_batch else small
    small = small if small is not None else full
    full = full if full is not None else small
    if small is None or full is None:
        return None
    at = full_batch if full_batch and full_batch > 1 else max(2, slots)
    batch = min(batch, slots)
    # Beyond the batch the full step was measured at, a step is taken to grow in
    # proportion to its batch: an upper bound (a step's fixed part does not grow), where
    # a line through the small-batch figure would be a guess (when small batches' steps
    # carried their prefills, the line ran flat from 12.4 ms to 12.0 at 48; a burst
    # filling 64 slots ran at ~18 and the two gateways of test_overload admitted 320 to
    # 384 requests finishing at up to 15 s). An idle engine's profile measures every slot.
    if batch >= at:
        return full * batch / at
    # A bigger batch never steps faster (a noisy small-batch figure above the full one is
    # not believed). The line runs from the batch the small figure was measured at: drawn
    # from batch 1, it put llama.cpp's 8-request step (74 ms, full 413 ms at 64) at 117 ms
    # for a ninth request, and refused 70-94% of 8 users' 64-token turns answered in 4 s.
    small = min(small, full)
    lo = small_batch if small_batch and small_batch < at else 1
    if batch <= lo:
        return small
    return small + (full - small) * (batch - lo) / (at - lo)


def too_long_alone(
    field: str,
    model: str,
    tokens: int,
    alone_step_s: float | None,
    budget_s: float,
    overhead_s: float = 0.0,
    max_deadline_s: float | None = None,
) -> str | None:
    """Why `tokens` can never be made within a deadline of `budget_s`, even with nothing
    else to run (`alone_step_s`, a worker's median step with one request in its batch,
    plus `overhead_s` outside decoding), naming `field` first and the most tokens that
    fit, and a longer deadline when one up to `max_deadline_s` would do; None when they
    fit, or the step is unmeasured. The gateway's 400 and the worker's refusal both say it."""
    if alone_step_s is None:
        return None
    alone = overhead_s + tokens * alone_step_s
    if alone <= budget_s:
        return None
    outside = f", {overhead_s:g} s outside decoding" if overhead_s else ""
    longer = ""
    if max_deadline_s is not None and alone <= max_deadline_s and budget_s < max_deadline_s:
        longer = f", or a deadline_s up to {max_deadline_s:g}"
    return (
        f"{field}: {tokens} tokens take about {alone:.1f} s on model '{model}' even with nothing else to run "
        f"(a token every {alone_step_s * 1000:.0f} ms{outside}), over the request's {budget_s:g} s deadline; "
        f"ask for at most {math.floor((budget_s - overhead_s) / alone_step_s)} tokens{longer}"
    )


def shared_batch(ends: tuple[int, ...] | list[int], queued: int, mean: float, budget: int, slots: int) -> int:
    """The batch a request of `budget` tokens joining now shares its steps with, on average
    over them: itself and, at each of its steps, those running now that are still running
    then (`ends`, their budgets left) or the `mean` where more (arrivals keep the batch
    at its mean), `queued` requests beside them counted throughout; at most `slots`.
    The gateway's admission (`ModelQueue.life_batch`) and the worker's too-late check
    both judge a turn's steps at it."""
    running = sorted(ends)[:slots]
    shared, start = 0.0, 0
    for i, ends_at in enumerate([*running, budget]):  # `len(running) - i` still run up to it
        if (end := min(ends_at, budget)) > start:
            shared += (end - start) * max(len(running) - i + queued, mean)
            start = end
    return min(slots, round(1 + shared / budget)) if budget > 0 else min(slots, len(running) + queued + 1)
