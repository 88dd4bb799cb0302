"""The goodput benchmark's counting (`bench.goodput`): what a turn in time is, how late
and cut turns are told apart, the rate, and the latencies of what came back whole."""

from __future__ import annotations

import itertools

import pytest

from bench.admission import Attempt
from bench.goodput import arrivals, outcome, table, tally

pytestmark = pytest.mark.timeout(30)

DEADLINE = 15.0


def attempt(status: int | None, latency: float | None = None, error: str | None = None, code: str | None = None):
    a = Attempt(0, 0, 64, 0.0, http_status=status, latency_s=latency, error=error, error_code=code)
    a.output_tokens = 64 if latency is not None else 0
    return a


def test_each_way_a_turn_ends():
    assert outcome(attempt(200, 14.9), DEADLINE) == "in_time"
    assert outcome(attempt(200, 15.1), DEADLINE) == "late"  # a server without deadlines answered after it
    assert outcome(attempt(504, 60.0, "TimeoutError: "), DEADLINE) == "late"  # the client gave up waiting
    cut_in_stream = attempt(200, None, "{'message': 'generation ended: deadline'}", "deadline_exceeded")
    assert outcome(cut_in_stream, DEADLINE) == "cut"
    assert outcome(attempt(504, None, "HTTP 504: deadline"), DEADLINE) == "cut"
    assert outcome(attempt(429, None, "HTTP 429: overloaded", "overloaded"), DEADLINE) == "refused"
    assert outcome(attempt(200, None, "overloaded", "overloaded"), DEADLINE) == "refused"  # a worker's, before a token
    assert outcome(attempt(400, None, "HTTP 400", "deadline_too_short"), DEADLINE) == "error"
    assert outcome(attempt(500, None, "HTTP 500"), DEADLINE) == "error"


def test_goodput_counts_only_turns_in_time_per_second_of_arrivals():
    attempts = [attempt(200, 2.0), attempt(200, 4.0), attempt(200, 20.0), attempt(429), attempt(504, None, "HTTP 504")]
    t = tally(attempts, duration_s=10.0, deadline_s=DEADLINE)
    assert t.offered == 5
    assert t.counts == {"in_time": 2, "refused": 1, "late": 1, "cut": 1, "error": 0}
    assert t.goodput == pytest.approx(0.2)
    assert (t.p50_s, t.p99_s) == (pytest.approx(4.0), pytest.approx(19.68))  # in time and late: what came back whole


def test_nothing_answered_has_no_latency():
    t = tally([attempt(429)], duration_s=10.0, deadline_s=DEADLINE)
    assert (t.goodput, t.p50_s, t.p99_s) == (0.0, None, None)


def test_arrivals_are_poisson_at_the_rate_and_the_same_for_every_target():
    times = arrivals(4.0, 500.0)
    assert times == arrivals(4.0, 500.0) and times != arrivals(4.0, 500.0, seed=1)
    assert all(0 < a < b < 500.0 for a, b in itertools.pairwise(times))
    assert len(times) == pytest.approx(2000, rel=0.1)


def test_table_puts_each_target_beside_llama_server_at_the_same_rate():
    rows = [
        {"rate": 3.0, "target": t, "load": "1.0", "tally": tally(a, 10.0, DEADLINE).as_json()}
        for t, a in (("llama-server", [attempt(200, 3.0)] * 2), ("arenaflow", [attempt(200, 3.0)] * 3))
    ]
    last = table(rows).splitlines()[-1].split(" | ")
    assert last[1:3] == ["arenaflow", "3"] and last[4:6] == ["0.30", "1.50"]
