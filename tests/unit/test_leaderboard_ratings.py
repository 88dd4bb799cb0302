"""Bradley–Terry ratings, intervals, ranks, online Elo and the incremental state, without NATS."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from pydantic import ValidationError

from consumers.leaderboard.ratings import (
    CountTable,
    FitDidNotConverge,
    Gauge,
    LeaderboardConfig,
    LeaderboardState,
    OnlineElo,
    Vote,
    aggregate,
    bootstrap_intervals,
    build_leaderboard,
    compute_leaderboard,
    fit_bradley_terry,
    online_elo,
    sandwich_intervals,
)
from consumers.leaderboard.ratings import ranks as rank_rule

pytestmark = pytest.mark.timeout(30)

TRUE = {"m0": 1200.0, "m1": 1120.0, "m2": 1060.0, "m3": 1000.0, "m4": 980.0, "m5": 940.0, "m6": 900.0, "m7": 800.0}


def wikipedia_votes() -> list[Vote]:
    """en.wikipedia.org/wiki/Bradley–Terry_model, worked example: 4 teams, 22 games."""
    games = [("A", "B", 2, 3), ("A", "D", 1, 4), ("B", "C", 5, 3), ("C", "D", 1, 3)]
    votes = []
    for a, b, won, lost in games:
        votes += [Vote(a, b, "a")] * won + [Vote(a, b, "b")] * lost
    return votes


def simulate(true: dict[str, float], n: int, seed: int, tie_rate: float = 0.1) -> list[Vote]:
    """Votes whose expected score is the Bradley–Terry probability, with ties as half a win.

    Ties take `tie_rate` of each pair's votes and the decisive split is adjusted so that
    E[score] = P(a beats b): the model being fitted is then the true one (and the tie
    noise is what the sandwich's robustness is for).
    """
    rng = np.random.default_rng(seed)
    names = sorted(true)
    ia = rng.integers(0, len(names), n)
    ib = (ia + rng.integers(1, len(names), n)) % len(names)
    ra, rb = np.array([true[m] for m in names])[ia], np.array([true[m] for m in names])[ib]
    p = 1.0 / (1.0 + 10.0 ** ((rb - ra) / 400.0))
    a_wins = (p - tie_rate / 2) / (1 - tie_rate)
    u, tie, kind = rng.random(n), rng.random(n) < tie_rate, rng.random(n) < 0.5
    outcomes = np.where(tie, np.where(kind, "tie", "both_bad"), np.where(u < a_wins, "a", "b"))
    return [Vote(names[a], names[b], str(o)) for a, b, o in zip(ia, ib, outcomes, strict=True)]  # type: ignore[arg-type]


def test_wikipedia_example_strengths() -> None:
    fit = fit_bradley_terry(aggregate(wikipedia_votes()))
    strengths = fit.strengths()  # 10^θ, geometric mean 1
    assert math.prod(strengths.values()) == pytest.approx(1.0)
    for model, expected in {"A": 0.640, "B": 1.043, "C": 0.660, "D": 2.270}.items():
        assert round(strengths[model], 3) == expected
    assert fit.grad_norm <= 1e-10


def test_ratings_are_the_arena_scale_and_mean_gauge() -> None:
    fit = fit_bradley_terry(aggregate(wikipedia_votes()))
    r = dict(zip(fit.models, fit.ratings, strict=True))
    assert np.mean(fit.ratings) == pytest.approx(1000.0, abs=1e-9)
    np.testing.assert_allclose(fit.ratings, 1000.0 + 400.0 * fit.theta, atol=1e-9)
    # 10^θ are the strengths: P(D beats A) = s_D / (s_A + s_D) = 1 / (1 + 10^((R_A - R_D)/400))
    s = fit.strengths()
    assert 1 / (1 + 10 ** ((r["A"] - r["D"]) / 400)) == pytest.approx(s["D"] / (s["A"] + s["D"]))


def test_tie_counts_as_half_a_win_each_way_like_fastchat() -> None:
    # FastChat's compute_mle_elo weights each decisive vote twice and a tie once each way.
    with_ties = CountTable.from_cells(
        {("x", "y", "a"): 7, ("x", "y", "tie"): 4, ("y", "z", "b"): 3, ("y", "z", "a"): 5}
    )
    doubled = CountTable.from_cells(
        {("x", "y", "a"): 14 + 4, ("x", "y", "b"): 4, ("y", "z", "b"): 6, ("y", "z", "a"): 10}
    )
    np.testing.assert_allclose(
        fit_bradley_terry(with_ties, l2=0).ratings, fit_bradley_terry(doubled, l2=0).ratings, atol=1e-7
    )


def test_swapped_sides_and_shuffled_order_change_nothing() -> None:
    votes = simulate(TRUE, 2000, seed=1)
    swapped = [v.swapped() if k % 3 == 0 else v for k, v in enumerate(votes)]
    random.Random(7).shuffle(swapped)
    config = LeaderboardConfig(interval="bootstrap", bootstrap_rounds=20)
    a, b = compute_leaderboard(votes, config), compute_leaderboard(swapped, config)
    assert a.digest() == b.digest()
    assert aggregate(votes).to_cells() == aggregate(swapped).to_cells()
    assert [r.model for r in a.rows] == [r.model for r in b.rows]


def test_digest_is_pinned_and_sensitive() -> None:
    board = compute_leaderboard(wikipedia_votes())
    # The canonical JSON is a contract: changing it needs a new DIGEST_VERSION and this value.
    assert board.digest() == "29e29a230f64196be1501f4a72c23ebcf6672645eb2bf3bc645596eeadc629b4"
    assert compute_leaderboard([*wikipedia_votes(), Vote("A", "C", "tie")]).digest() != board.digest()
    assert compute_leaderboard(wikipedia_votes(), LeaderboardConfig(min_votes=5)).digest() != board.digest()
    # the Elo trend depends on vote order, so it is not part of the digest
    assert compute_leaderboard(wikipedia_votes()[::-1]).digest() == board.digest()


def test_bootstrap_and_sandwich_interval_widths_agree() -> None:
    fit = fit_bradley_terry(aggregate(simulate(TRUE, 4000, seed=2)))
    sandwich = sandwich_intervals(fit)
    boot = bootstrap_intervals(fit, rounds=300, seed=3)
    sw, bw = sandwich.high - sandwich.low, boot.high - boot.low
    assert abs(bw.mean() / sw.mean() - 1) < 0.10
    assert np.all(np.abs(bw / sw - 1) < 0.25)  # per model, with 300 resamples of noise in each tail


def test_intervals_cover_true_ratings_at_about_the_nominal_rate() -> None:
    truth = np.array([TRUE[m] for m in sorted(TRUE)])
    hits = {"sandwich": 0, "bootstrap": 0}
    sims = 20
    for seed in range(sims):
        fit = fit_bradley_terry(aggregate(simulate(TRUE, 3000, seed=100 + seed)))
        for iv in (sandwich_intervals(fit), bootstrap_intervals(fit, rounds=100, seed=seed)):
            hits[iv.method] += int(((iv.low <= truth) & (truth <= iv.high)).sum())
    for method, hit in hits.items():
        assert 0.85 <= hit / (sims * len(TRUE)) <= 1.0, method


def test_anchor_gauge_puts_the_anchor_at_its_rating() -> None:
    table = aggregate(simulate(TRUE, 3000, seed=4))
    mean = fit_bradley_terry(table)
    anchored = fit_bradley_terry(table, gauge=Gauge(rating=1114.0, anchor="m3"))
    assert anchored.rating("m3") == 1114.0
    np.testing.assert_allclose(anchored.ratings - anchored.rating("m3"), mean.ratings - mean.rating("m3"), atol=1e-9)
    iv = sandwich_intervals(anchored)
    k = anchored.models.index("m3")
    assert iv.low[k] == iv.high[k] == 1114.0
    board = compute_leaderboard(simulate(TRUE, 500, seed=4), LeaderboardConfig(anchor="m7", rating=800.0))
    assert board.row("m7").rating == 800.0
    with pytest.raises(ValueError, match="'nope'"):
        fit_bradley_terry(table, gauge=Gauge(anchor="nope"))


def test_rank_is_one_plus_models_clearly_above() -> None:
    low = np.array([10.0, 8.0, 5.0, 1.0])
    high = np.array([12.0, 11.0, 9.0, 4.0])
    # model 2's upper 9 is below model 0's lower 10 only; model 3 is below all three
    assert rank_rule(low, high).tolist() == [1, 1, 2, 4]
    board = compute_leaderboard(simulate(TRUE, 6000, seed=5))
    assert board.row("m0").rank == 1
    assert board.row("m7").rank == 8
    assert board.rows[0].model == "m0"


def test_provisional_below_min_votes() -> None:
    votes = [*simulate(TRUE, 1000, seed=6), *[Vote("new", "m3", "a")] * 5]
    board = compute_leaderboard(votes, LeaderboardConfig(min_votes=100))
    assert board.row("new").provisional and board.row("new").votes == 5
    assert not any(r.provisional for r in board.rows if r.model != "new")
    assert sum(r.votes for r in board.rows) == 2 * board.total_votes


def test_model_that_never_lost_stays_finite() -> None:
    votes = [*wikipedia_votes(), *[Vote("E", "A", "a")] * 3]
    board = compute_leaderboard(votes)
    assert math.isfinite(board.row("E").rating) and board.row("E").rating == board.rows[0].rating
    with pytest.raises(FitDidNotConverge):
        fit_bradley_terry(aggregate(votes), l2=0.0, max_iter=5)


def test_win_rates_and_votes_per_model() -> None:
    table = aggregate([Vote("x", "y", "a"), Vote("y", "x", "a"), Vote("x", "y", "tie"), Vote("y", "z", "both_bad")])
    assert table.win_rates()["x"]["y"] == pytest.approx(0.5)
    assert table.win_rates()["z"]["y"] == pytest.approx(0.5)
    assert "z" not in table.win_rates()["x"]
    assert table.votes_per_model() == {"x": 3, "y": 4, "z": 1}


def test_online_elo_follows_fastchat() -> None:
    elo = online_elo([Vote("a1", "b1", "a")])
    assert elo == {"a1": 1002.0, "b1": 998.0}  # K=4, expected score 0.5
    tracker = OnlineElo()
    tracker.update("p", "q", "tie")
    assert tracker.ratings == {"p": 1000.0, "q": 1000.0}
    votes = simulate(TRUE, 20000, seed=8)
    elo = online_elo(votes)
    assert sum(elo.values()) == pytest.approx(1000.0 * len(TRUE))  # zero-sum updates
    assert max(elo, key=elo.get) == "m0" and min(elo, key=elo.get) == "m7"
    assert compute_leaderboard(votes).row("m0").elo == elo["m0"]


def test_incremental_state_matches_a_fit_from_scratch() -> None:
    votes = simulate(TRUE, 3000, seed=9)
    state = LeaderboardState()
    for start in range(0, len(votes), 500):
        state.extend(votes[start : start + 500])
        live = state.leaderboard()
    scratch = build_leaderboard(aggregate(votes))
    np.testing.assert_allclose(live.fit.ratings, scratch.fit.ratings, atol=1e-8)
    assert live.digest() == scratch.digest()
    assert live.fit.iterations < scratch.fit.iterations  # warm start
    state.add(Vote("late", "m0", "b"))  # a model that appears later starts at the mean
    assert state.leaderboard().row("late").votes == 1


def test_votes_are_validated_and_empty_board_works() -> None:
    with pytest.raises(ValueError, match="itself"):
        Vote("x", "x", "a")
    with pytest.raises(ValueError, match="outcome"):
        Vote("x", "y", "model_a")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        LeaderboardConfig(interval="wald")  # type: ignore[arg-type]
    board = compute_leaderboard([])
    assert board.rows == () and board.total_votes == 0 and len(board.digest()) == 64


def test_a_variant_with_three_wins_ranks_below_a_model_with_206_votes() -> None:
    """The newcomer's case: a variant that won its 3 votes against an established model.
    The plain MLE runs away (the sandwich interval on separated data is narrow too);
    the board's prior keeps it finite, its interval wide, and its rank below."""
    votes, n = [], 0
    for v in simulate(TRUE, 1200, seed=11):
        if "m0" in (v.model_a, v.model_b):
            if n == 203:
                continue
            n += 1
        votes.append(v)
    votes += [Vote("variant", "m0", "a")] * 3
    plain = fit_bradley_terry(aggregate(votes), l2=1e-6)
    k = plain.models.index("variant")
    narrow = sandwich_intervals(plain)
    assert plain.ratings[k] > 2500 and narrow.high[k] - narrow.low[k] < 400  # the artefact

    board = compute_leaderboard(votes)
    variant, m0 = board.row("variant"), board.row("m0")
    assert m0.votes == 206 and not m0.provisional and variant.provisional and variant.votes == 3
    assert math.isfinite(variant.rating) and variant.rating < 1700
    assert variant.ci_high - variant.ci_low > 600 and variant.ci_low < m0.rating < variant.ci_high
    assert variant.rank > m0.rank
    order = [r.model for r in board.rows]
    assert order.index("variant") > order.index("m0")
    assert [r.rank for r in board.rows] == sorted(r.rank for r in board.rows)
    # With enough wins the evidence is real: a provisional model can then rank first.
    strong = compute_leaderboard([*votes[:-3], *[Vote("variant", "m0", "a")] * 29], LeaderboardConfig())
    assert strong.row("variant").ci_low > strong.row("m0").rating and strong.rows[0].model == "variant"


def test_min_votes_has_one_default() -> None:
    from consumers.leaderboard.settings import MIN_VOTES, LeaderboardSettings

    assert LeaderboardConfig().min_votes == LeaderboardSettings().min_votes == MIN_VOTES == 30
