"""Seconds to compute the arena leaderboard from a large vote set, on one core.

Simulates votes between `--models` models with known ratings (uniform random pairs, 10%
ties), then times each stage: counting votes into the table, the Bradley–Terry fit
(cold, and warm-started after more votes as the live path does), the sandwich intervals
and the bootstrap. Prints figures; asserts nothing, since speed depends on the machine.

BLAS is held to one thread unless OPENBLAS_NUM_THREADS is set: the matrices are at most
models × models, too small to gain from threads, and on a busy machine OpenBLAS's
spinning threads made each 100 × 100 solve 20 times slower (see docs/arena-statistics.md).

    nice -n 10 python -m bench.leaderboard_speed [--models 100] [--votes 1000000] [--rounds 100]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads OpenBLAS

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar, cast

import numpy as np

from consumers.leaderboard.ratings import (
    LeaderboardState,
    StyleRows,
    Vote,
    aggregate,
    bootstrap_intervals,
    build_style_leaderboard,
    canonical,
    fit_bradley_terry,
    sandwich_intervals,
)
from consumers.leaderboard.votes import Outcome

T = TypeVar("T")


def simulate(models: int, votes: int, seed: int, tie_rate: float = 0.1) -> tuple[dict[str, float], list[Vote]]:
    """Votes whose expected score is the Bradley–Terry probability (ties as half a win)."""
    rng = np.random.default_rng(seed)
    names = [f"model-{k:03d}" for k in range(models)]
    true = rng.normal(1000.0, 120.0, models)
    ia = rng.integers(0, models, votes)
    ib = (ia + rng.integers(1, models, votes)) % models
    p = 1.0 / (1.0 + 10.0 ** ((true[ib] - true[ia]) / 400.0))
    a_wins = np.clip((p - tie_rate / 2) / (1 - tie_rate), 0.0, 1.0)
    tie = rng.random(votes) < tie_rate
    outcomes = np.where(
        tie, np.where(rng.random(votes) < 0.5, "tie", "both_bad"), np.where(rng.random(votes) < a_wins, "a", "b")
    )
    records = [
        Vote(names[a], names[b], cast(Outcome, str(o)))
        for a, b, o in zip(ia.tolist(), ib.tolist(), outcomes.tolist(), strict=True)
    ]
    return dict(zip(names, true.tolist(), strict=True)), records


def style_rows(votes: list[Vote], seed: int) -> StyleRows:
    """The votes as style control reads them, with made-up answer tokens and markdown counts."""
    counts = np.random.default_rng(seed).poisson([300, 1, 2, 1.5] * 2, size=(len(votes), 8)).astype(float)
    rows = StyleRows()
    rows.a, rows.b = [v.model_a for v in votes], [v.model_b for v in votes]
    rows.y = [{"a": 1.0, "b": 0.0}.get(v.outcome, 0.5) for v in votes]
    rows.counts = [tuple(c) for c in counts.tolist()]
    rows.cells = Counter(canonical(v.model_a, v.model_b, v.outcome) for v in votes)
    return rows


def state_style(rows: StyleRows, init):
    board = build_style_leaderboard(rows, init=init)
    assert board is not None
    return board


def timed(label: str, fn: Callable[[], T]) -> T:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    print(f"  {label:<44} {time.perf_counter() - wall:8.3f} s wall {time.process_time() - cpu:8.3f} s cpu")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=100)
    ap.add_argument("--votes", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=100, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print(f"leaderboard speed: {args.models} models, {args.votes:,} votes, {args.rounds} bootstrap rounds")
    blas = os.environ["OPENBLAS_NUM_THREADS"]
    print(f"  numpy {np.__version__}, {os.cpu_count()} cpus visible, OPENBLAS_NUM_THREADS={blas}")
    true, votes = timed(
        "simulate votes (not part of the pipeline)", lambda: simulate(args.models, args.votes, args.seed)
    )
    table = timed("aggregate votes into the count table", lambda: aggregate(votes))
    cells = int((table.counts > 0).sum())
    print(f"    {len(table.pairs)} pairs, {cells} non-empty cells (at most {len(table.pairs) * 4})")
    fit = timed("Bradley–Terry fit, cold start", lambda: fit_bradley_terry(table))
    print(f"    {fit.iterations} Newton steps, gradient per vote {fit.grad_norm:.1e}")
    timed("sandwich intervals", lambda: sandwich_intervals(fit))
    boot = timed(f"bootstrap intervals ({args.rounds} rounds)", lambda: bootstrap_intervals(fit, args.rounds))

    state = LeaderboardState()
    timed("LeaderboardState.add, all votes", lambda: state.extend(votes))
    timed("state.leaderboard(), first (cold) refit", state.leaderboard)
    extra = simulate(args.models, 1000, args.seed + 1)[1]
    state.extend(extra)
    live = timed("state.leaderboard() after +1,000 votes (warm)", state.leaderboard)
    print(f"    {live.fit.iterations} Newton steps warm-started")

    styled = timed("style counts for every vote (simulated)", lambda: style_rows(votes, args.seed))
    style = timed("style-controlled board, cold (fit, sandwich)", lambda: state_style(styled, None))
    init = (dict(zip(style.fit.models, style.fit.theta.tolist(), strict=True)), style.fit.gamma)
    timed("style-controlled board, warm-started", lambda: state_style(styled, init))

    truth = np.array([true[m] for m in fit.models])
    truth += 1000.0 - truth.mean()
    err = np.abs(fit.ratings - truth)
    width = boot.high - boot.low
    print(f"  max |rating - truth| {err.max():.2f} points; median bootstrap 95% width {np.median(width):.2f} points")


if __name__ == "__main__":
    main()
