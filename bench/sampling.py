"""Votes needed to pin the ratings down, by pair sampling policy: a simulation with known truth.

Models get true ratings; each vote draws its pair by the policy under test (the gateway's
own `gateway.arena.pairing`), its outcome from the Bradley–Terry truth (10% ties), and
every `--check-every` votes the leaderboard is refitted (the board's own fit and
intervals) until the widest 95% interval is at most `--width` points. Two scenarios:

* a fresh arena: every model starts with no votes;
* a new model joins an arena whose models already have `--established` votes each; the
  clock stops when the new model's own interval is that narrow.

Policies: uniform (FastChat's default), boost (LMArena's weight 5 for a model under
3,000 votes; in a fresh arena every model is under, so it is uniform there) and active
(the pair one more vote informs most). Prints the median over `--seeds` and the
ratings' error against the truth; asserts nothing.

    python -m bench.sampling [--models 10] [--width 100] [--seeds 5]
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import random
from collections import Counter
from statistics import median

import numpy as np

from consumers.leaderboard.ratings import CountTable, LeaderboardConfig, build_leaderboard, canonical
from gateway.arena.pairing import PairPolicy, active_pair, sample_pair

POLICIES = {
    "uniform": PairPolicy(),
    "boost": PairPolicy(boost_until=3000),
    "active": PairPolicy(sampling="active"),
}


class Arena:
    """Simulated votes: counts per cell and each pair's record as the gateway reads it."""

    def __init__(self, true: dict[str, float], rng: np.random.Generator, tie_rate: float) -> None:
        self.true, self.rng, self.tie_rate = true, rng, tie_rate
        self.cells: Counter[tuple[str, str, str]] = Counter()
        self.votes: Counter[str] = Counter()

    def vote(self, a: str, b: str) -> None:
        p = 1 / (1 + 10 ** ((self.true[b] - self.true[a]) / 400))
        u = self.rng.random()
        if u < self.tie_rate:
            outcome = "tie"
        else:
            outcome = "a" if self.rng.random() < (p - self.tie_rate / 2) / (1 - self.tie_rate) else "b"
        self.cells[canonical(a, b, outcome)] += 1
        self.votes[a] += 1
        self.votes[b] += 1

    def pairs(self) -> dict[tuple[str, str], tuple[int, float]]:
        record: dict[tuple[str, str], list[int]] = {}
        for (x, y, outcome), c in self.cells.items():
            record.setdefault((x, y), [0, 0, 0])["ab".find(outcome) if outcome in "ab" else 2] += c
        out = {}
        for pair, (w, losses, t) in record.items():
            n = w + losses + t
            mean = (w + 0.5 * t) / n
            out[pair] = (n, (w + 0.25 * t) / n - mean**2)
        return out

    def board(self):
        return build_leaderboard(CountTable.from_cells(self.cells), LeaderboardConfig())


def draw(policy: PairPolicy, arena: Arena, models: list[str], rng: random.Random) -> tuple[str, str]:
    resident = set(models)
    live = policy.with_votes(arena.votes, models)
    pair = active_pair(live, models, resident, arena.pairs(), rng) if live.sampling == "active" else None
    pair = pair or sample_pair(live, models, resident, rng)
    return pair.model_a, pair.model_b


def run(
    policy: PairPolicy, true: dict[str, float], args, seed: int, watch: str | None, start: int
) -> tuple[int, float]:
    """Votes until the widest interval (or `watch`'s) is at most args.width; and the RMSE then."""
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    arena = Arena(true, nrng, args.tie_rate)
    models = sorted(true)
    old = [m for m in models if m != watch]
    for _ in range(start):  # the established arena, drawn uniformly among the old models
        a, b = nrng.choice(old, 2, replace=False)
        arena.vote(str(a), str(b))
    cast = 0
    while cast < args.max_votes:
        for _ in range(args.check_every):
            arena.vote(*draw(policy, arena, models, rng))
        cast += args.check_every
        board = arena.board()
        widths = {r.model: r.ci_high - r.ci_low for r in board.rows}
        if (widths[watch] if watch else max(widths.values())) <= args.width:
            break
    shift = np.mean([true[r.model] for r in board.rows]) - 1000.0
    err = [r.rating + shift - true[r.model] for r in board.rows]
    return cast, float(np.sqrt(np.mean(np.square(err))))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=10)
    ap.add_argument("--spread", type=float, default=100.0, help="SD of the true ratings, points")
    ap.add_argument("--width", type=float, default=100.0, help="target width of a 95%% interval, points")
    ap.add_argument("--established", type=int, default=3500, help="votes per old model before a new one joins")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--check-every", type=int, default=100)
    ap.add_argument("--max-votes", type=int, default=40_000)
    ap.add_argument("--tie-rate", type=float, default=0.1)
    args = ap.parse_args(argv)
    names = [f"m{k:02d}" for k in range(args.models)]
    print(f"pair sampling: {args.models} models (true ratings SD {args.spread:g}), target 95% width {args.width:g}")
    for title, watch in (("fresh arena, widest interval", None), ("a new model joins, its interval", names[-1])):
        start = 0 if watch is None else args.established * (args.models - 1) // 2
        print(f"\n  {title}" + (f" ({args.established} votes per old model first)" if watch else ""))
        print(f"  {'policy':<10} {'votes (median)':>15} {'range':>15} {'RMSE (points)':>14}")
        for name, policy in POLICIES.items():
            results = []
            for seed in range(args.seeds):
                true_rng = np.random.default_rng(1000 + seed)
                true = dict(zip(names, (1000 + true_rng.normal(0, args.spread, args.models)).tolist(), strict=True))
                results.append(run(policy, true, args, seed, watch, start))
            votes = [v for v, _ in results]
            rmse = median(r for _, r in results)
            print(f"  {name:<10} {median(votes):>15,.0f} {f'{min(votes):,}-{max(votes):,}':>15} {rmse:>14.1f}")


if __name__ == "__main__":
    main()
