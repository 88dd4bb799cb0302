"""EngineRunner's speed estimate, on a stand-in engine (pure logic, no model)."""

from __future__ import annotations

import asyncio
import statistics
import time
from types import SimpleNamespace

import pytest

from consumers.inference.protocol import EngineStats, GenRequest, StepOutput
from consumers.inference.runner import MIN_SAMPLES, EngineRunner, steps_until_slot, typical_step


class QueueOnly:
    """An engine backend (consumers.inference.protocol.EngineBackend) with a queue and no
    model: what the runner's estimate reads. The runner's thread is stopped at once, so
    nothing ever steps it."""

    max_batch_size = 32
    loaded = SimpleNamespace(spec=SimpleNamespace(name="toy"))
    queue = EngineStats()

    def add(self, req: GenRequest) -> None:
        raise AssertionError("not stepped")

    def cancel(self, request_id: str) -> None:
        pass

    def step(self) -> list[StepOutput]:
        raise AssertionError("not stepped")

    def fail_all(self) -> list[StepOutput]:
        return []

    def timed_steps(self) -> None:
        return None

    def stats(self) -> EngineStats:
        return self.queue

    def close(self) -> None:
        pass


@pytest.fixture
def runner():
    r = EngineRunner(QueueOnly(), asyncio.new_event_loop(), lambda outputs: None)  # type: ignore[arg-type]
    r.stop()
    return r


def test_no_estimate_until_enough_steps_were_measured(runner):
    """Cold steps (warm-up, a burst's prefills) must not refuse work: the first
    MIN_SAMPLES - 1 measurements give no estimate, however slow they were."""
    for _ in range(MIN_SAMPLES - 1):
        runner._measure(20, 0.5)
    assert runner.finish_at(200) is None
    runner._measure(20, 0.5)
    assert runner.finish_at(200) == pytest.approx(time.time() + 100, abs=1)


def test_estimate_is_the_mean_step_without_the_rare_outliers(runner):
    """A rare slow step (warm-up, a collection: at most a tenth) does not move the
    estimate; steps that carry a newcomer's prefill, as many do under arrivals, do: a
    request's tokens take the mean step, not the median one."""
    for took in [0.01] * (MIN_SAMPLES + 2) + [5.0] * 2:
        runner._measure(20, took)
    assert runner.finish_at(100) == pytest.approx(time.time() + 1.0, abs=0.1)
    runner._full.clear()
    runner._small.clear()
    for _ in range(MIN_SAMPLES):  # 60 % decode-only steps, 40 % with a prefill
        runner._measure(20, 0.07)
        runner._measure(20, 0.07)
        runner._measure(20, 0.07)
        runner._measure(20, 0.15)
        runner._measure(20, 0.15)
    mean = typical_step(list(runner._full))
    assert 0.095 < mean < 0.1 and statistics.median(runner._full) == 0.07
    assert runner.finish_at(100) == pytest.approx(time.time() + 100 * mean, abs=0.1)


def test_estimate_counts_the_requests_ahead_of_it(runner):
    """A request pulled behind a full batch and a queue starts when a slot frees for it."""
    for _ in range(MIN_SAMPLES):
        runner._measure(32, 0.01)
    runner.engine.queue = EngineStats((50,) * 32, (100,) * 32)  # a full batch half done, a batch waiting
    assert runner.finish_at(100) == pytest.approx(time.time() + (50 + 100 + 100) * 0.01, abs=0.1)
    runner.engine.queue = EngineStats((50,) * 31)  # a slot free: it joins at once
    assert runner.finish_at(100) == pytest.approx(time.time() + 1.0, abs=0.1)


def test_estimate_extrapolates_to_the_batch_it_will_join(runner):
    """Steps measured at a batch of 16 (a load of 16 users) and a jump to 32: the request
    joins a batch of 32, which steps slower than any measured; as the gateway's admission
    does, the step time is extrapolated (beyond the batch measured, in proportion to it)."""
    for _ in range(MIN_SAMPLES):
        runner._measure(4, 0.04)  # small batches (< half the slots)
        runner._measure(16, 0.056)  # half the slots: counted as full, at 16
    runner.engine.queue = EngineStats((64,) * 16, (128,) * 15)  # 16 running, 15 just arrived: it takes the last slot
    assert runner.finish_at(128) == pytest.approx(time.time() + 128 * 0.056 * 2, abs=0.1)  # 112 ms at 32
    runner.engine.queue = EngineStats((64,) * 16)  # the batch it joins is 17: about the measured one
    assert runner.finish_at(128) == pytest.approx(time.time() + 128 * 0.056 * 17 / 16, abs=0.1)


def test_steps_until_a_slot():
    assert steps_until_slot([], [], 4) == 0
    assert steps_until_slot([10, 20, 30, 40], [], 4) == 10
    assert steps_until_slot([10, 20, 30, 40], [5], 4) == 15  # the first free slot goes to the one waiting
    assert steps_until_slot([10, 20], [100, 100, 100], 3) == 100  # 1 free (0+100), 10+100, 20+100 -> 100 first


class CountingEngine(QueueOnly):
    """Steps `steps` times, each producing one output, as fast as it can."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def stats(self) -> EngineStats:
        return EngineStats(running=(self.left,)) if self.left > 0 else EngineStats()

    def step(self) -> list:
        self.left -= 1
        return [SimpleNamespace(request_id="r", step=self.left)]


async def test_outputs_reach_the_loop_in_step_order_with_wake_ups_coalesced():
    """Steps that end while the loop is busy go over in one wake-up, none lost or reordered."""
    calls: list[list] = []
    done = asyncio.Event()
    runner = EngineRunner(CountingEngine(200), asyncio.get_running_loop(), calls.append)  # type: ignore[arg-type]
    try:
        time.sleep(0.2)  # the loop is blocked: the engine's outputs pile up for one delivery
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, done.set)
        await done.wait()
    finally:
        runner.stop()
    delivered = [o.step for outs in calls for o in outs]
    assert delivered == list(range(199, -1, -1))
    assert len(calls) < 200


def test_the_step_alone_is_the_median_of_batch_one_steps(runner):
    """How fast a request goes alone: the median of the steps with one request in the
    batch (its prefill step aside), none until MIN_SAMPLES were measured; bigger batches
    do not count."""
    for _ in range(MIN_SAMPLES - 2):
        runner._measure(1, 0.05)
    runner._measure(1, 0.9)  # a prefill
    runner._measure(4, 0.2)
    assert runner.load().alone_step_s is None
    runner._measure(1, 0.05)
    assert runner.load().alone_step_s == pytest.approx(0.05)


def test_a_worker_refuses_what_it_cannot_finish_even_alone():
    """Judged from the request's receipt, not from now: a request that waited is late
    (429 overloaded, elsewhere), not too long."""
    from runtime.steps import too_long_alone

    assert too_long_alone("max_tokens", "m", 1000, None, 15.0) is None  # not measured
    assert too_long_alone("max_tokens", "m", 1000, 0.01, 15.0) is None  # 10 s of a 15 s budget
    why = too_long_alone("max_tokens", "m", 1000, 0.02, 15.0)
    assert why is not None and why.startswith("max_tokens: 1000 tokens take about 20.0 s") and "at most 750" in why
