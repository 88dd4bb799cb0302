"""The deadline-aware admission estimator (pure logic)."""

from __future__ import annotations

import time

import pytest

from gateway.admission import LocalAdmissions, ModelQueue, StreamState, combine, estimate, retry_after_s, step_at


def q(requests=0, tokens=0, slots=32, step_s=0.01, full_step_s=0.02) -> ModelQueue:
    return ModelQueue(slots, requests, tokens, step_s, full_step_s)


def test_an_idle_fleet_answers_in_the_budget_times_a_step():
    est = estimate(q(), budget=100, overhead_s=0.1)
    assert est is not None and est.wait_s == 0
    assert est.finish_s == pytest.approx(0.1 + 100 * 0.01)


def test_nothing_measured_means_no_estimate():
    assert estimate(q(step_s=None, full_step_s=None), 100, 0.1) is None
    assert estimate(q(slots=0), 100, 0.1) is None


def test_step_time_grows_from_small_to_full_batches():
    queue = q(slots=32)
    assert step_at(queue, 1) == pytest.approx(0.01)
    assert step_at(queue, 16) == pytest.approx(0.02)
    assert step_at(queue, 32) == pytest.approx(0.02)
    assert step_at(q(step_s=None), 1) == pytest.approx(0.02)  # only near-full measured: use it


def test_work_beyond_the_slots_is_waited_for_in_waves():
    # 64 requests of 128 tokens ahead, 32 slots: this one waits for 2 waves (33 beyond / 32 slots, rounded up).
    est = estimate(q(requests=64, tokens=64 * 128), budget=128, overhead_s=0)
    assert est is not None
    assert est.wait_s == pytest.approx(2 * 128 * 0.02)
    assert est.finish_s == pytest.approx(3 * 128 * 0.02)


def test_the_estimate_grows_with_the_queue_and_the_margin():
    finishes = [estimate(q(requests=n, tokens=n * 128), 128, 0.1).finish_s for n in (0, 31, 32, 100, 400)]
    assert finishes == sorted(finishes) and finishes[-1] > finishes[0] * 5
    assert estimate(q(), 100, 0.0, margin=1.5).finish_s == pytest.approx(1.5)


def test_retry_after_is_the_overshoot_in_whole_seconds():
    est = estimate(q(requests=400, tokens=400 * 128), 128, 0.1)
    assert retry_after_s(est, 15.0) == int(est.finish_s - 15.0) + 1
    assert retry_after_s(estimate(q(), 10, 0.0), 15.0) == 1


def test_combine_counts_the_stream_and_fresh_admissions_once():
    workers = q(requests=10, tokens=1000)
    merged = combine(workers, StreamState(ahead=5, held=20, read_at=1.0), 3, 300, mean_budget=64)
    # held 20 per the consumer, of which 10 with budgets known from heartbeats; 5 ahead; 3 admitted here since.
    assert merged.requests == 5 + 20 + 3
    assert merged.tokens == 1000 + 300 + (5 + 10) * 64


def test_local_admissions_count_until_the_stream_state_shows_them():
    local = LocalAdmissions()
    now = time.time()
    for _ in range(3):
        local.admitted("m", 128, now)
    assert local.queue("m", q(), StreamState(read_at=now - 1)).requests == 3
    assert local.queue("m", q(), StreamState(read_at=now + 1)).requests == 0  # read after: the stream has them
    assert local.queue("other", q(), StreamState()).requests == 0


def test_a_burst_is_refused_beyond_what_fits_in_the_deadline():
    """400 requests of 128 tokens against 32 slots at 20 ms a step (2.56 s a wave): the
    first few waves fit in 15 s, the rest is refused, all by one gateway's own count."""
    local = LocalAdmissions()
    stream = StreamState(read_at=time.time() - 0.1)
    admitted = 0
    for _ in range(400):
        est = estimate(local.queue("m", q(), stream), 128, 0.3, 1.2)
        if est.finish_s <= 15.0:
            local.admitted("m", 128)
            admitted += 1
    assert 32 * 3 <= admitted <= 32 * 5
