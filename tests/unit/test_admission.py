"""The deadline-aware admission estimator (pure logic)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import fakeredis
import pytest

from gateway.admission.estimate import Endings, ModelQueue, StreamState, combine, estimate, retry_after_s, step_at
from gateway.admission.recent import FleetAdmissions


def q(requests=0, tokens=0, slots=32, step_s=0.01, full_step_s=0.02, measured_at=None) -> ModelQueue:
    return ModelQueue(slots, requests, tokens, step_s, full_step_s, time.time() if measured_at is None else measured_at)


def test_an_idle_fleet_answers_in_the_budget_times_a_step():
    est = estimate(q(), budget=100, overhead_s=0.1)
    assert est is not None and est.wait_s == 0
    assert est.finish_s == pytest.approx(0.1 + 100 * 0.01)


def test_nothing_measured_lets_one_wave_through():
    assert estimate(q(step_s=None, full_step_s=None), 100, 0.1).finish_s == pytest.approx(0.1)
    assert estimate(q(requests=31, step_s=None, full_step_s=None), 100, 0.1).finish_s == pytest.approx(0.1)
    unknown = estimate(q(requests=32, step_s=None, full_step_s=None), 100, 0.1)
    assert unknown.finish_s == float("inf") and retry_after_s(unknown, 15) == 1
    assert estimate(q(slots=0), 100, 0.1).finish_s == pytest.approx(0.1)  # no worker ran it yet


def test_an_idle_fleet_with_stale_measurements_is_probed():
    slow = q(step_s=1.0, full_step_s=1.0, measured_at=time.time() - 60)
    assert estimate(slow, 100, 0.1).finish_s == pytest.approx(0.1)  # admitted: its answer measures anew
    assert estimate(q(requests=1, tokens=10, step_s=1.0, full_step_s=1.0, measured_at=0), 100, 0.1).finish_s > 100


def test_step_time_grows_from_small_to_full_batches():
    queue = q(slots=32)
    assert step_at(queue, 1) == pytest.approx(0.01)
    assert step_at(queue, 16) == pytest.approx(0.01 + 0.01 * 15 / 31)
    assert step_at(queue, 32) == pytest.approx(0.02)
    assert step_at(q(step_s=None), 1) == pytest.approx(0.02)  # only near-full measured: use it


def test_step_time_is_extrapolated_past_the_batch_it_was_measured_at():
    # measured at batch 24 of 48 slots (a steady load); a burst fills all 48: beyond the
    # batch measured, in proportion to the batch (an upper bound)
    queue = ModelQueue(48, 0, 0, 0.01, 0.02, time.time(), full_batch=24)
    assert step_at(queue, 24) == pytest.approx(0.02)
    assert step_at(queue, 36) == pytest.approx(0.03)
    assert step_at(queue, 48) == pytest.approx(0.04)
    assert step_at(queue, 100) == step_at(queue, 48)  # never beyond the slots


def test_work_beyond_the_slots_is_waited_for_in_waves():
    # 64 requests of 128 tokens ahead, 32 slots: this one waits for 2 waves (33 beyond / 32 slots, rounded up).
    est = estimate(q(requests=64, tokens=64 * 128), budget=128, overhead_s=0)
    assert est is not None
    assert est.wait_s == pytest.approx(2 * 128 * 0.02)
    assert est.finish_s == pytest.approx(3 * 128 * 0.02)


def test_the_estimate_grows_with_the_queue_and_the_margin():
    finishes = [estimate(q(requests=n, tokens=n * 128), 128, 0.1).finish_s for n in (0, 31, 32, 100, 400)]
    assert finishes == sorted(finishes) and finishes[-1] > finishes[0] * 5
    assert estimate(q(requests=1, tokens=10, full_step_s=0.01), 100, 0.0, margin=1.5).finish_s == pytest.approx(1.5)
    assert estimate(q(), 100, 0.0, margin=1.5).finish_s == pytest.approx(1.0)  # idle: no margin, so it runs


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


def test_a_heartbeat_newer_than_the_stream_state_is_not_counted_twice():
    # The stream state was read before a burst (nothing held); since then 100 were admitted
    # and the workers' heartbeat already shows 60 of them pulled.
    workers = q(requests=60, tokens=60 * 128)
    merged = combine(workers, StreamState(ahead=0, held=0, read_at=1.0), 100, 100 * 128, mean_budget=128)
    assert merged.requests == 100 and merged.tokens == 100 * 128
    # A heartbeat showing more than all of them (work from before the read) counts in full.
    assert combine(q(requests=150, tokens=150 * 64), StreamState(), 0, 0, 128).requests == 150


class Judged:
    """A judge that records what each request saw and refuses past `limit` ahead."""

    def __init__(self, limit: int = 10**9):
        self.limit, self.seen = limit, []

    def __call__(self, stream, n: int, tokens: int):
        self.seen.append((n, tokens))
        return estimate(q(), 1, 0.0) if n >= self.limit else None


async def test_fleet_admissions_are_seen_by_every_gateway_at_once():
    redis = fakeredis.FakeAsyncRedis()
    state = StreamState(read_at=time.time() - 1)
    one, two = FleetAdmissions(redis, lambda: state), FleetAdmissions(redis, lambda: state)  # two gateways
    judge = Judged()
    r1, _ = await one.admit("m", 128, judge)
    r2, _ = await two.admit("m", 64, judge)
    r3, _ = await one.admit("m", 32, judge)
    assert judge.seen == [(0, 0), (1, 128), (2, 192)]
    await two.remove("m", r3, 32)  # refused after all
    # Not yet published: counted whatever the stream state says, until published.
    state = StreamState(read_at=time.time() + 1)
    r4, _ = await two.admit("m", 8, judge)
    assert judge.seen[-1] == (2, 192)
    for member, tokens in ((r1, 128), (r2, 64), (r4, 8)):
        await one.published("m", member, tokens)
    state = StreamState(read_at=time.time() - 1)  # a state read before: not there yet
    await two.admit("m", 8, judge)
    assert judge.seen[-1] == (3, 200)
    state = StreamState(read_at=time.time() + 1)  # read after: the stream shows them (the last is pending)
    await two.admit("m", 8, judge)
    assert judge.seen[-1] == (1, 8)
    await one.admit("other", 8, judge)
    assert judge.seen[-1] == (0, 0)


async def test_requests_waiting_together_are_judged_in_one_call_in_order():
    """A burst's requests are judged with the ones admitted before them (not the refused),
    the refusals are answered first, and a refused or abandoned request is not recorded."""
    redis = fakeredis.FakeAsyncRedis()
    gateway = FleetAdmissions(redis, StreamState)
    judge, order = Judged(limit=3), []

    async def one(i: int):
        member, refused = await gateway.admit("m", 10, judge)
        order.append(i)
        return member, refused

    abandoned = asyncio.ensure_future(gateway.admit("m", 10, judge))
    tasks = [asyncio.ensure_future(one(i)) for i in range(5)]
    await asyncio.sleep(0)
    abandoned.cancel()
    results = await asyncio.gather(*tasks)
    assert judge.seen == [(0, 0), (1, 10), (2, 20), (3, 30), (3, 30)]  # the abandoned one is not judged
    assert [refused is None for _, refused in results] == [True, True, True, False, False]
    assert order[:2] == [3, 4]  # the refusals wake first
    await asyncio.gather(*gateway._background)
    kept = {m.decode().rpartition(":")[0] for m in await redis.zrange("arena:admitted:m", 0, -1)}
    assert kept == {member for member, refused in results if refused is None}


def test_a_burst_is_refused_beyond_what_fits_in_the_deadline():
    """400 requests of 128 tokens against 32 slots at 20 ms a step (2.56 s a wave): the
    first few waves fit in 15 s, the rest is refused."""
    admitted = tokens = 0
    for _ in range(400):
        queue = combine(q(), StreamState(), admitted, tokens, 128)
        est = estimate(queue, 128, 0.3, 1.2)
        if est.finish_s <= 15.0:
            admitted, tokens = admitted + 1, tokens + 128
    assert 32 * 3 <= admitted <= 32 * 5


def test_a_small_batch_measured_slower_than_a_full_one_is_not_believed():
    """Prefill-heavy small batches can have a median above the full batches': the step at
    any batch up to the one the full step was seen at is then the full one's."""
    inflated = ModelQueue(64, 0, 0, 0.030, 0.013, time.time(), full_batch=48)
    assert step_at(inflated, 1) == pytest.approx(0.013)
    assert step_at(inflated, 48) == pytest.approx(0.013)
    assert step_at(inflated, 64) == pytest.approx(0.013 * 64 / 48)  # beyond: in proportion
    usual = ModelQueue(64, 0, 0, 0.010, 0.013, time.time(), full_batch=48)
    assert step_at(usual, 24) == pytest.approx(0.010 + 0.003 * 23 / 47)
    assert step_at(usual, 64) == pytest.approx(0.013 * 64 / 48)


def test_an_idle_fleet_judges_a_request_by_the_step_alone_as_the_400_does():
    """Alone, a request steps at the median batch-1 step, the figure `never` judges it by:
    what an idle fleet refuses is then a 400 (change the request), never a 429 that every
    retry would get again (the mean small-batch step, prefills in it, said 22 s where alone
    took 14)."""
    from dataclasses import replace

    from gateway.admission.estimate import never

    idle = replace(q(step_s=0.024, full_step_s=0.024), alone_step_s=0.015)
    assert estimate(idle, 900, 0.5).finish_s == pytest.approx(0.5 + 900 * 0.015)
    assert not never(idle, 900, 15.0, 0.5)
    assert estimate(replace(idle, requests=1, tokens=50), 900, 0.5).finish_s == pytest.approx(0.5 + 900 * 0.024)
    unmeasured = q(step_s=0.024, full_step_s=0.024)  # alone not measured
    assert estimate(unmeasured, 900, 0.5).finish_s == pytest.approx(0.5 + 900 * 0.024)


def test_newcomers_prefills_stretch_the_steps_of_a_busy_fleet_only():
    """The workers' prefill share (the busiest's) stretches decode steps by 1 / (1 - share)
    where others are running beside the request, at most 3x; an idle fleet has no one
    arriving beside it, and a share with no step after it for its window is over."""
    from dataclasses import replace

    from events.fleet import EngineLoad, ModelLoad

    busy = replace(q(requests=10, tokens=640, step_s=0.02, full_step_s=0.02), prefill_share=0.5)
    assert estimate(busy, 64, 0.5).finish_s == pytest.approx(0.5 + 64 * 0.04)
    assert estimate(replace(busy, prefill_share=0.9), 64, 0.5).finish_s == pytest.approx(0.5 + 64 * 0.06)
    assert estimate(replace(busy, requests=0, tokens=0), 64, 0.5).finish_s == pytest.approx(0.5 + 64 * 0.02)
    stale = replace(busy, measured_at=time.time() - 6)  # no step for longer than the share's window
    assert estimate(stale, 64, 0.5).finish_s == pytest.approx(0.5 + 64 * 0.02)
    shares = ModelLoad().plus(EngineLoad(prefill_share=0.1)).plus(EngineLoad(prefill_share=0.3)).plus(EngineLoad())
    assert shares.prefill_share == 0.3


def test_a_budget_too_long_even_alone_is_a_400_naming_the_field():
    from dataclasses import replace

    from gateway.admission.estimate import alone_s, too_slow

    queue = replace(q(requests=5, tokens=300, measured_at=0), alone_step_s=0.06)  # stale, busy: neither matters
    assert alone_s(queue, 256, 0.5) == pytest.approx(0.5 + 256 * 0.06)
    error = too_slow("smollm2", queue, "max_tokens", 256, 15.0, 120.0, 0.5)
    assert error is not None and error.status == 400 and error.code == "deadline_too_short"
    assert error.param == "max_tokens"
    assert "at most 241 tokens, or a deadline_s up to 120" in error.message
    assert too_slow("smollm2", queue, "max_tokens", 241, 15.0, 120.0, 0.5) is None
    # Too long for the longest deadline too: only fewer tokens would do.
    error = too_slow("smollm2", queue, "max_completion_tokens", 4000, 15.0, 120.0, 0.5)
    assert error is not None and "deadline_s" not in error.message and error.param == "max_completion_tokens"
    assert too_slow("smollm2", q(), "max_tokens", 100_000, 15.0, 120.0, 0.5) is None  # not measured: let through
    # A deadline shorter than the fixed overhead never fits, measured or not: it names deadline_s.
    for fleet in (q(), queue):
        error = too_slow("smollm2", fleet, "max_tokens", 16, 0.3, 120.0, 0.5)
        assert error is not None and error.status == 400 and error.param == "deadline_s"


def test_the_fleet_alone_is_its_fastest_worker():
    from events.fleet import EngineLoad, ModelLoad

    load = ModelLoad().plus(EngineLoad(alone_step_s=0.08)).plus(EngineLoad()).plus(EngineLoad(alone_step_s=0.05))
    assert load.alone_step_s == 0.05
    assert ModelLoad().plus(EngineLoad()).alone_step_s is None


def test_with_only_small_batches_measured_steps_grow_in_proportion_beyond_them():
    """A fresh stack's steps were measured at 1-4 requests: a first wave of 32 is judged
    by them grown in proportion past their batch, not flat (llama.cpp on SmolLM2: 35 ms
    at 2 requests, ~150 ms at 32; taken flat, 18 of 110 turns were admitted and missed)."""
    from runtime.steps import step_time

    assert step_time(0.035, None, None, 32, 1, small_batch=2) == pytest.approx(0.035)
    assert step_time(0.035, None, None, 32, 2, small_batch=2) == pytest.approx(0.035)
    assert step_time(0.035, None, None, 32, 32, small_batch=2) == pytest.approx(0.56)
    assert step_time(0.035, None, None, 32, 64, small_batch=2) == pytest.approx(0.56)  # no more than the slots
    assert step_time(0.035, None, None, 32, 32) == pytest.approx(0.035)  # batch unknown (older beats): as before
    assert step_time(0.035, 0.15, 32, 32, 32, small_batch=2) == pytest.approx(0.15)  # once full is measured


def test_a_request_that_ended_after_the_beat_and_the_stream_read_is_not_ahead_of_the_next():
    """One client's requests back to back (SmolLM2, 256 tokens each): the first has ended,
    but the last heartbeat and stream read still hold it. Counted, the next is judged
    beside it at the margin (16.6 s, a 429 on an idle fleet); taken off, it is judged
    alone, as the fleet is. An end before either read is theirs to count."""
    workers = ModelQueue(64, 1, 200, 0.040, 0.099, time.time(), 64, 0.037, 1, heard_at=100.0)
    stream = StreamState(0, 1, 100.5)
    endings = Endings()
    endings.add("m", now=99.9)  # a beat and the stream read after it know it ended
    held = combine(workers, stream, 0, 0, 256.0, endings, "m")
    assert (held.requests, held.tokens) == (1, 200)
    endings.add("m", now=101.0)
    idle = combine(workers, stream, 0, 0, 256.0, endings, "m")
    assert (idle.requests, idle.tokens) == (0, 0)
    alone = estimate(idle, 256, 0.5, margin=1.65, now=101.5)
    beside = estimate(held, 256, 0.5, margin=1.65, now=101.5)
    assert alone.finish_s == pytest.approx(0.5 + 256 * 0.037) and alone.margin == 1.0
    assert beside.finish_s > 15.0 > alone.finish_s
    # Two requests running, one of them ended: the other's share of the budgets stays.
    two = combine(ModelQueue(64, 2, 400, 0.04, 0.099, 0.0, heard_at=100.0), stream, 0, 0, 256.0, endings, "m")
    assert (two.requests, two.tokens) == (1, 200)


def test_the_step_line_starts_at_the_batch_the_small_steps_ran_at():
    """llama.cpp's heartbeat under 8 users: 74 ms a step at 8 requests, 413 ms at 64. A
    ninth request steps at about the eighth's, not at a line drawn from batch 1."""
    from runtime.steps import step_time

    assert step_time(0.074, 0.413, 64, 64, 9, small_batch=8) == pytest.approx(0.074 + 0.339 / 56)
    assert step_time(0.074, 0.413, 64, 64, 8, small_batch=8) == pytest.approx(0.074)
    assert step_time(0.074, 0.413, 64, 64, 3, small_batch=8) == pytest.approx(0.074)  # below it: no less
    assert step_time(0.074, 0.413, 64, 64, 64, small_batch=8) == pytest.approx(0.413)
    assert step_time(0.074, 0.413, 32, 64, 64, small_batch=8) == pytest.approx(0.413 * 2)  # beyond: in proportion
    assert step_time(0.074, 0.413, 64, 64, 9) == pytest.approx(0.074 + 0.339 * 8 / 63)  # batch unknown: from 1


def test_a_turn_is_judged_at_the_busiest_batch_of_the_last_window():
    """8 users in conversation, 3 of them decoding when a 256-token turn arrives: its steps
    are counted at the batch of 8 the workers ran lately, not at the 4 of the moment."""
    now = ModelQueue(64, 3, 3 * 64, 0.03, 0.413, time.time(), full_batch=64, small_batch=2)
    assert estimate(now, 256, 0.5).step_s == pytest.approx(0.03 + 0.383 * 2 / 62)  # at 4
    busy = replace(now, recent_running=8)
    assert estimate(busy, 256, 0.5).step_s == pytest.approx(0.03 + 0.383 * 6 / 62)  # at 8
    assert estimate(replace(busy, requests=30), 256, 0.5).step_s == pytest.approx(0.03 + 0.383 * 29 / 62)  # now's


def test_a_request_beyond_the_slots_waits_for_the_first_to_end_not_the_mean():
    """llama.cpp's 32 slots full under arrivals, their budgets left spread from 2 to 64: a
    33rd request gets the slot of the one with 2 tokens left, a 34th the next (4); past a
    whole round of queued requests, each queued one's own budget is added. Without the
    running budgets (an older worker's beat) it waits the mean of all, as before."""
    from gateway.admission.estimate import slot_wait

    ends = tuple(range(2, 66, 2))  # 32 running
    full = ModelQueue(32, 32, sum(ends), 0.04, 0.1, time.time(), full_batch=32, ends=ends)
    assert slot_wait(full) == 2
    est = estimate(full, 64, 0.5)
    assert est.wait_s == pytest.approx(2 * 0.1) and est.finish_s == pytest.approx(0.5 + 66 * 0.1)
    assert slot_wait(replace(full, requests=33, tokens=sum(ends) + 64)) == 4  # one queued ahead: the second slot
    assert slot_wait(replace(full, requests=32 + 32, tokens=sum(ends) + 32 * 64)) == 2 + 64  # a round ahead
    assert slot_wait(replace(full, requests=10, ends=ends[:8])) == 0  # free slots: no wait
    unknown = estimate(replace(full, ends=()), 64, 0.5)
    assert unknown.wait_s == pytest.approx(sum(ends) / 32 * 0.1)  # the mean budget left, a step each


def test_the_requests_that_ended_since_the_beat_leave_the_slots_they_held():
    ends = (1, 5, 40)
    workers = ModelQueue(3, 3, sum(ends), 0.01, 0.02, time.time(), heard_at=time.time() - 1, ends=ends)
    endings = Endings()
    endings.add("m")
    q = combine(workers, StreamState(read_at=time.time() - 1), 0, 0, 64.0, endings, "m")
    assert (q.requests, q.ends) == (2, (5, 40))


def test_a_turn_is_judged_at_the_mean_batch_of_the_window_where_workers_say_it():
    """llama.cpp's backend at 2 requests/s: 16 running on average over the last 15 s, 23 at
    the busiest moment. A turn arriving beside 10 shares its steps with the mean and
    itself (17), not the peak: judged at 23, turns estimated at 15-19 s were refused that
    its server answered in 12-13 s. A turn joining more than the mean is judged there."""
    q = ModelQueue(32, 10, 10 * 32, 0.03, 0.243, time.time(), full_batch=32, small_batch=2, recent_running=23)
    at = lambda batch: 0.03 + (0.243 - 0.03) * (batch - 2) / 30  # noqa: E731 - the step line
    assert estimate(q, 64, 0.5).batch == 23  # an older worker's beat: the busiest
    mean = replace(q, mean_running=15.6)
    est = estimate(mean, 64, 0.5)
    assert est.batch == 17 and est.step_s == pytest.approx(at(17))
    assert estimate(replace(mean, requests=20), 64, 0.5).batch == 21  # more now than the mean
    assert estimate(replace(mean, mean_running=40.0), 64, 0.5).batch == 32  # never past the slots


def test_the_mean_running_sums_over_workers_and_stays_unsaid_from_older_ones():
    from events.fleet import EngineLoad, ModelLoad

    assert ModelLoad().plus(EngineLoad()).mean_running is None
    assert ModelLoad().plus(EngineLoad(mean_running=3.5)).plus(EngineLoad()).mean_running == 3.5
    assert ModelLoad().plus(EngineLoad(mean_running=3.5)).plus(EngineLoad(mean_running=1.0)).mean_running == 4.5


def test_a_turn_is_judged_at_the_batch_its_steps_share_as_those_running_now_end():
    """A moment's cluster of Poisson arrivals: 18 running, their budgets left spread over
    a 64-token answer, 9 on average over the window. A 64-token turn shares its steps with
    fewer and fewer of them, and with the mean's arrivals once they are gone (at least
    9 besides itself): 12 on average, not 19 (it was refused there at 2 requests/s, where
    the server answered every turn by 8 s). A burst's requests, all with their whole
    budgets left, are shared with throughout; requests queued beside them too."""
    ends = tuple(range(2, 64, 64 // 18))[:18]
    q = ModelQueue(32, 18, sum(ends), 0.03, 0.243, time.time(), full_batch=32, small_batch=2, ends=ends)
    assert q.life_batch(64) == 19  # an older worker's beat (no mean): the batch it joins
    cluster = replace(q, mean_running=9.0)
    shared = sum(max(sum(e > k for e in ends), 9.0) for k in range(64)) / 64
    assert cluster.life_batch(64) == round(1 + shared) == 12
    assert estimate(cluster, 64, 0.5).batch == 12
    burst = replace(cluster, ends=(64,) * 18, tokens=18 * 64)
    assert burst.life_batch(64) == 19
    assert replace(burst, requests=24).life_batch(64) == 25  # 6 more queued in the stream
    assert (
        replace(burst, requests=40).life_batch(64) == 41 and estimate(replace(burst, requests=40), 64, 0.5).batch == 32
    )
