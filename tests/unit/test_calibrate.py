"""The admission margin learned from what admitted requests really took (pure logic)."""

from __future__ import annotations

import pytest

from gateway.admission.calibrate import CEILING, FLOOR, LESSONS_KEEP_S, MIN_SAMPLES, Calibration, Judged
from gateway.admission.estimate import ModelQueue, estimate


def test_needed_is_the_real_work_over_the_estimated_one_for_the_tokens_made():
    judged = Judged(wait_s=4.0, step_s=0.1)
    # 64 tokens made (of any budget): 4 + 6.4 s estimated; it took 0.5 s of hops + 12.6 s.
    assert judged.needed(13.1, 64, 0.5, 15.0) == pytest.approx(12.6 / 10.4)
    assert judged.needed(0.3, 64, 0.5, 15.0) == 0.0  # faster than the hops alone
    assert Judged(0.0, 0.01).needed(2.0, 50, 0.5, 2.0) is None  # 0.5 s of work: says little of steps
    assert judged.needed(5.0, 0, 0.5, 15.0) is None
    # Far from its deadline (10.4 s of work of 119.5 s), the margin decided nothing: not counted;
    # nor under 70 % of 15 s (NEAR_EDGE), where the estimate errs otherwise than at the edge.
    assert judged.needed(13.1, 64, 0.5, 120.0) is None
    assert Judged(wait_s=2.0, step_s=0.1).needed(11.1, 64, 0.5, 15.0) is None


def test_needed_is_against_the_batch_the_request_shared_not_the_one_it_was_judged_at():
    """Judged beside a few (0.1 s a step), it shared the burst admitted after it (0.14 s a
    step by the figures): its 4 s wait and 64 tokens in 13.46 s needed 1.0x the figures,
    not the 1.25x its estimate says. Judged at a batch a quiet spell never reached (0.2 s),
    its 0.1 s steps needed 1.0x too, and far from the edge say nothing of a margin."""

    def figures(batch: float) -> float:  # the step line it was judged by: 0.1 s at 8, 0.14 s at 11.2
        return 0.0125 * batch

    judged = Judged(wait_s=4.0, step_s=0.1, line=figures)
    assert judged.needed(13.46, 64, 0.5, 15.0) == pytest.approx(12.96 / 10.4)
    assert judged.needed(13.46, 64, 0.5, 15.0, shared_batch=11.2) == pytest.approx(12.96 / 12.96)
    quiet = Judged(wait_s=4.0, step_s=0.2, line=figures)
    assert quiet.needed(10.9, 64, 0.5, 15.0, shared_batch=8) == pytest.approx(10.4 / 10.4)
    assert quiet.needed(3.0, 64, 0.5, 15.0, shared_batch=4) is None  # 7.2 s of work: far from the edge


def test_the_margin_is_the_configured_one_until_enough_were_seen_then_their_p99_within_bounds():
    cal = Calibration(1.5)
    for _ in range(MIN_SAMPLES - 1):
        cal.record("m", 1.1)
    cal.record("m", None)  # not counted
    assert cal.margin("m") == 1.5 and cal.margin("other") == 1.5
    cal.record("m", 1.1)
    assert cal.margin("m") == pytest.approx(1.1)
    cal.record("m", 2.0)  # one of 21 needed more: under 100 seen, the 99th percentile is the highest
    assert cal.margin("m") == pytest.approx(2.0)
    full = Calibration(1.5)
    for _ in range(198):
        full.record("m", 1.1)
    full.record("m", 2.0)
    full.record("m", 2.5)  # of 200, the second highest
    assert full.margin("m") == pytest.approx(2.0)
    low = Calibration(1.5)
    for _ in range(MIN_SAMPLES):
        low.record("m", 0.4)  # requests that stopped early never lower it under the floor
    assert low.margin("m") == FLOOR
    high = Calibration(1.5)
    for _ in range(MIN_SAMPLES):
        high.record("m", 9.0)
    assert high.margin("m") == CEILING


def test_the_window_forgets_old_lessons():
    cal = Calibration(1.5, window=30)
    for _ in range(30):
        cal.record("m", 3.0)
    for _ in range(30):
        cal.record("m", 1.2)
    assert cal.margin("m") == pytest.approx(1.2)


def test_an_estimate_knows_its_parts_without_the_margin():
    queue = ModelQueue(slots=2, requests=3, tokens=120, step_s=0.1, full_step_s=0.1, measured_at=1e18)
    est = estimate(queue, 64, 0.5, margin=1.5)
    judged = est.judged()
    assert judged.step_s == pytest.approx(0.1) and est.step_s == pytest.approx(0.15)
    assert judged.wait_s == pytest.approx(est.wait_s / 1.5) and judged.wait_s > 0
    idle = estimate(ModelQueue(2, 0, 0, 0.1, 0.1, measured_at=1e18), 64, 0.5, margin=1.5)
    assert idle.margin == 1.0 and idle.judged().step_s == pytest.approx(0.1)  # an idle fleet: no margin


def test_at_a_high_margin_turns_near_the_edge_as_judged_still_teach_it():
    """A margin of 3 (two cut turns) admits 64-token turns of ~70 ms a step: 4.5 s of work
    for a 15 s deadline, under a third of it. Judged without the margin they taught nothing
    and the margin stayed at 3 for good; near the edge as judged (x3), they teach it."""
    assert Judged(0.0, 0.07).needed(5.2, 64, 0.5, 15.0) is None  # admitted at margin 1: far from the edge
    high = Judged(0.0, 0.07, margin=3.0)
    assert high.needed(5.2, 64, 0.5, 15.0) == pytest.approx(4.7 / 4.48)
    calibration = Calibration(1.5)
    for _ in range(2):
        calibration.record("m", CEILING)
    for _ in range(400):
        calibration.record("m", high.needed(5.2, 64, 0.5, 15.0))
    assert calibration.margin("m") == pytest.approx(4.7 / 4.48)  # the two ceilings left the window


def test_a_cut_turn_records_how_far_off_the_figures_were_for_what_it_made():
    """Cut at its 15 s deadline after 50 of 64 tokens, judged at 150 ms a step with a
    margin of 1.2: its 50 tokens took 14.5 s, 1.93x the 7.5 s figured; not the ceiling."""
    judged = Judged(0.0, 0.15, margin=1.2)
    assert judged.needed(15.0, 50, 0.5, 15.0, cut=True) == pytest.approx(14.5 / 7.5)
    assert judged.needed(15.0, 0, 0.5, 15.0, cut=True) == CEILING  # nothing made: the most there is
    far = Judged(0.0, 0.01)
    assert far.needed(15.0, 5, 0.5, 15.0, cut=True) == pytest.approx(14.5 / 0.05)  # clamped when recorded


def test_the_lived_batch_is_the_time_weighted_mean_of_the_running_over_a_requests_life():
    """A request admitted at 0 beside 4, the load grown to 17 from 4 s on: it shared 11.8
    on average by 10 s; its step is read at the batch it shared off the figures it was
    judged by (a machine that slowed after it was judged is what its margin learns)."""
    from gateway.admission.calibrate import SAMPLE_EVERY_S, LivedBatches

    lived = LivedBatches()
    assert lived.mean("m", 0.0, 10.0) is None
    lived.add("m", -1.0, 4.0)
    assert not lived.due("m", -1.0 + SAMPLE_EVERY_S / 2) and lived.due("m", -1.0 + SAMPLE_EVERY_S)
    lived.add("m", 4.0, 17.0)
    assert lived.mean("m", 0.0, 10.0) == pytest.approx((4 * 4 + 17 * 6) / 10)
    assert lived.mean("m", 5.0, 10.0) == pytest.approx(17.0)
    lived.add("other", 9.0, 2.0)  # samples only after it was admitted: those count
    assert lived.mean("other", 0.0, 10.0) == pytest.approx(2.0)
    judged = Judged(0.0, 0.05, 1.0, line=lambda batch: 0.01 * batch)
    assert judged.needed(10.74, 64, 0.5, 15.0, shared_batch=16.0) == pytest.approx(10.24 / 10.24)
    assert judged.needed(7.3, 64, 0.5, 15.0) is None  # no batch: as judged, 3.2 s, far from the edge


def test_old_lessons_hold_a_margin_up_no_longer():
    """Turns cut with no token (each the ceiling) are forgotten after a minute when few
    lessons followed them (a margin of 3 admits few turns near the edge): the margin
    comes back to the configured one, where it stayed at 3 for the next 197 lessons."""
    now = [0.0]
    cal = Calibration(1.25, clock=lambda: now[0])
    for _ in range(MIN_SAMPLES):
        cal.record("m", 1.05)
    for _ in range(4):
        cal.record("m", CEILING)
    assert cal.margin("m") == CEILING
    now[0] = LESSONS_KEEP_S / 2
    cal.record("m", 1.1)
    assert cal.margin("m") == CEILING  # still recent
    now[0] = LESSONS_KEEP_S + 1
    assert cal.margin("m") == 1.25  # one recent lesson: the configured margin
    for _ in range(MIN_SAMPLES):
        cal.record("m", 1.08)
    assert cal.margin("m") == pytest.approx(1.1)  # the last minute's own


def test_old_lessons_may_keep_a_margin_low():
    now = [0.0]
    cal = Calibration(1.25, clock=lambda: now[0])
    for _ in range(MIN_SAMPLES):
        cal.record("m", 1.05)
    now[0] = 10 * LESSONS_KEEP_S
    assert cal.margin("m") == pytest.approx(1.05)


def test_an_estimate_that_says_too_much_learns_a_margin_under_one():
    """At llama-server's knee the turns near the edge took 0.86-0.90 of their estimate:
    the margin follows them down (to FLOOR at most), where it stopped at 1 and refused
    turns estimated at 15-17 s that took 12-14."""
    cal = Calibration(1.25)
    for i in range(MIN_SAMPLES * 5):
        cal.record("m", 0.80 + 0.001 * (i % 100))
    assert 0.85 < cal.margin("m") < 0.9
    assert FLOOR < 0.85
