"""The arena leaderboard: Bradley–Terry ratings, intervals, ranks, the online Elo trend.

    board = compute_leaderboard(votes)                 # from scratch
    state = LeaderboardState(); state.add(vote); state.leaderboard()   # live, warm-started

The fit and intervals live in `bradley_terry`, the count table in `votes`; this module
assembles them and re-exports what a caller needs.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from consumers.leaderboard.bradley_terry import (
    BASE,
    SCALE,
    BradleyTerryFit,
    FitDidNotConverge,
    Gauge,
    Intervals,
    bootstrap_intervals,
    bootstrap_ratings,
    fit_bradley_terry,
    floored,
    model_based_sd,
    sandwich_intervals,
)
from consumers.leaderboard.config import LeaderboardConfig
from consumers.leaderboard.style_control import (
    StyleBattles,
    StyleFit,
    StyleMetadataError,
    fit_style_control,
    style_bootstrap_ratings,
    style_counts,
    style_sandwich_cov,
)
from consumers.leaderboard.votes import OUTCOME_SCORE, OUTCOMES, CountTable, Vote, aggregate, canonical

__all__ = [
    "OUTCOMES",
    "BradleyTerryFit",
    "CountTable",
    "FitDidNotConverge",
    "Gauge",
    "Intervals",
    "Leaderboard",
    "LeaderboardConfig",
    "LeaderboardRow",
    "LeaderboardState",
    "OnlineElo",
    "StyleRows",
    "Vote",
    "aggregate",
    "bootstrap_intervals",
    "bootstrap_ratings",
    "build_leaderboard",
    "build_style_leaderboard",
    "canonical",
    "compute_leaderboard",
    "fit_bradley_terry",
    "online_elo",
    "sandwich_intervals",
]

DIGEST_VERSION = 2  # 2: provisional rows ranked by their lower bound, intervals floored
_ELO_SCORE = {"a": 1.0, "b": 0.0, "tie": 0.5, "both_bad": 0.5}


class OnlineElo:
    """FastChat's online Elo (`compute_elo` in elo_analysis.py): one K-factor update per vote, in order.

    A trend view only: it depends on the order of votes and forgets early ones, so it is
    not part of the leaderboard's digest.
    """

    def __init__(self, k: float = 4.0, scale: float = SCALE, base: float = BASE, init: float = 1000.0) -> None:
        self.k, self.scale, self.base, self.init = k, scale, base, init
        self.ratings: dict[str, float] = {}

    def update(self, model_a: str, model_b: str, outcome: str) -> None:
        ra = self.ratings.get(model_a, self.init)
        rb = self.ratings.get(model_b, self.init)
        expected_a = 1.0 / (1.0 + self.base ** ((rb - ra) / self.scale))
        delta = self.k * (_ELO_SCORE[outcome] - expected_a)
        self.ratings[model_a] = ra + delta
        self.ratings[model_b] = rb - delta


def online_elo(votes: Iterable[Vote], k: float = 4.0, init: float = 1000.0) -> dict[str, float]:
    """Online Elo over `votes` in the order given (sort by tstamp first for a time trend)."""
    elo = OnlineElo(k, init=init)
    for v in votes:
        elo.update(v.model_a, v.model_b, v.outcome)
    return elo.ratings


@dataclass(frozen=True)
class LeaderboardRow:
    model: str
    rating: float
    """Bradley–Terry rating in points on the configured gauge."""
    ci_low: float
    ci_high: float
    rank: int
    """1 + number of models whose ci_low is above this model's ci_high; for a provisional
    model at least 1 + the number of models rated above its ci_low."""
    votes: int
    provisional: bool
    """Fewer than `min_votes` votes."""
    elo: float | None
    """Online Elo trend; None when the leaderboard was built from counts without an order."""


def _num(x: float) -> str:
    text = f"{x:.6f}"
    return "0.000000" if text == "-0.000000" else text


@dataclass(frozen=True, eq=False)
class Leaderboard:
    """Rows best first (rank, then rating, then name), with what produced them."""

    rows: tuple[LeaderboardRow, ...]
    total_votes: int
    config: LeaderboardConfig
    win_rates: Mapping[str, Mapping[str, float]] = field(repr=False)
    """Empirical pairwise score (ties as half) of row model against column model."""
    fit: BradleyTerryFit | StyleFit = field(repr=False)
    style_coefficients: Mapping[str, float] | None = None
    """On a style-controlled board: logit change per standard deviation of each style
    feature (length, header, list, bold); None on the raw board."""

    def row(self, model: str) -> LeaderboardRow:
        for r in self.rows:
            if r.model == model:
                return r
        raise KeyError(model)

    def canonical(self) -> dict:
        """The order-independent results, rounded to 1e-6, as plain JSON data (no Elo)."""
        cfg = self.config.model_dump(exclude={"elo_k"})
        if cfg["interval"] != "bootstrap":
            cfg.pop("bootstrap_rounds")
            cfg.pop("seed")
        for key in ("rating", "level", "l2"):
            cfg[key] = repr(float(cfg[key]))
        rows = [
            {
                "model": r.model,
                "rating": _num(r.rating),
                "ci_low": _num(r.ci_low),
                "ci_high": _num(r.ci_high),
                "rank": r.rank,
                "votes": r.votes,
                "provisional": r.provisional,
            }
            for r in sorted(self.rows, key=lambda r: r.model)
        ]
        wins = [[x, y, _num(v)] for x in sorted(self.win_rates) for y, v in sorted(self.win_rates[x].items())]
        out = {
            "version": DIGEST_VERSION,
            "config": cfg,
            "total_votes": self.total_votes,
            "rows": rows,
            "win_rates": wins,
        }
        if self.style_coefficients is not None:
            out["style_coefficients"] = [[k, _num(v)] for k, v in self.style_coefficients.items()]
        return out

    def digest(self) -> str:
        """sha256 of the canonical JSON: equal for the same vote set and config on any machine."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()


def ranks(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """1 + how many models are better beyond doubt (their lower bound above this upper bound)."""
    return 1 + (low[None, :] > high[:, None]).sum(axis=1)


def placed_ranks(rating: np.ndarray, low: np.ndarray, high: np.ndarray, provisional: np.ndarray) -> np.ndarray:
    """`ranks`, except that a provisional model is ranked by what its interval assures: at
    least 1 + how many established models are rated above its lower bound. So a model with
    a few lucky votes never ranks above an established one on its point estimate alone."""
    established_above = ((rating[None, :] > low[:, None]) & ~provisional[None, :]).sum(axis=1)
    return np.where(provisional, np.maximum(ranks(low, high), 1 + established_above), ranks(low, high))


def _rows(
    models: tuple[str, ...],
    rating: np.ndarray,
    iv: Intervals,
    votes: Mapping[str, int],
    config: LeaderboardConfig,
    elo: Mapping[str, float] | None,
) -> list[LeaderboardRow]:
    provisional = np.array([votes[m] < config.min_votes for m in models], dtype=bool)
    rank = placed_ranks(rating, iv.low, iv.high, provisional)
    rows = [
        LeaderboardRow(
            model=m,
            rating=float(rating[k]),
            ci_low=float(iv.low[k]),
            ci_high=float(iv.high[k]),
            rank=int(rank[k]),
            votes=votes[m],
            provisional=bool(provisional[k]),
            elo=None if elo is None else elo.get(m),
        )
        for k, m in enumerate(models)
    ]
    rows.sort(key=lambda r: (r.rank, -r.rating, r.model))
    return rows


def build_leaderboard(
    table: CountTable,
    config: LeaderboardConfig | None = None,
    *,
    elo: Mapping[str, float] | None = None,
    init: np.ndarray | Mapping[str, float] | None = None,
) -> Leaderboard:
    """Fit `table` and assemble the rows; `init` warm-starts the fit (natural-log strengths)."""
    config = config or LeaderboardConfig()
    fit = fit_bradley_terry(table, gauge=config.gauge, l2=config.l2, init=init)
    if config.interval == "bootstrap":
        iv = bootstrap_intervals(fit, config.bootstrap_rounds, config.seed, config.level)
    else:
        iv = sandwich_intervals(fit, config.level)
    iv = floored(iv, fit.ratings, model_based_sd(fit))
    rows = _rows(table.models, fit.ratings, iv, table.votes_per_model(), config, elo)
    return Leaderboard(tuple(rows), table.total, config, table.win_rates(), fit)


@dataclass
class StyleRows:
    """The votes that carry style counts, kept as the style fit reads them (counts parsed once)."""

    a: list[str] = field(default_factory=list)
    b: list[str] = field(default_factory=list)
    y: list[float] = field(default_factory=list)
    counts: list[tuple[float, ...]] = field(default_factory=list)
    cells: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    def add(self, vote: Vote) -> None:
        if vote.conv_metadata is None:
            return
        try:
            counts = style_counts(vote.conv_metadata)
        except StyleMetadataError:  # metadata without the style counts (an older FastChat file)
            return
        self.a.append(vote.model_a)
        self.b.append(vote.model_b)
        self.y.append(float(OUTCOME_SCORE[OUTCOMES.index(vote.outcome)]))
        self.counts.append(counts)
        self.cells[canonical(vote.model_a, vote.model_b, vote.outcome)] += 1

    @classmethod
    def of(cls, votes: Iterable[Vote]) -> StyleRows:
        rows = cls()
        for v in votes:
            rows.add(v)
        return rows


def build_style_leaderboard(
    votes: Iterable[Vote] | StyleRows,
    config: LeaderboardConfig | None = None,
    *,
    elo: Mapping[str, float] | None = None,
    init: tuple[Mapping[str, float], np.ndarray] | None = None,
) -> Leaderboard | None:
    """The style-controlled board (FastChat's `compute_style_control`) over the votes that
    carry style counts; None when none does. `init` warm-starts from (θ by model name, γ)."""
    config = config or LeaderboardConfig()
    rows = votes if isinstance(votes, StyleRows) else StyleRows.of(votes)
    if not rows.y:
        return None
    battles, table = StyleBattles.build(rows.a, rows.b, rows.y, rows.counts), CountTable.from_cells(rows.cells)
    start = None if init is None else np.concatenate([[init[0].get(m, 0.0) for m in battles.models], init[1]])
    fit = fit_style_control(battles, gauge=config.gauge, init=start)
    robust, model_based = style_sandwich_cov(fit)
    if config.interval == "bootstrap":
        samples, _ = style_bootstrap_ratings(fit, config.bootstrap_rounds, config.seed)
        low, high = np.quantile(samples, [(1.0 - config.level) / 2.0, (1.0 + config.level) / 2.0], axis=0)
        iv = Intervals("bootstrap", config.level, low, high)
    else:
        iv = floored(Intervals("sandwich", config.level, fit.ratings, fit.ratings), fit.ratings, _sd(robust))
    iv = floored(iv, fit.ratings, _sd(model_based))
    board_rows = _rows(battles.models, fit.ratings, iv, battles.votes_per_model(), config, elo)
    return Leaderboard(tuple(board_rows), len(battles), config, table.win_rates(), fit, fit.coefficients)


def _sd(cov: np.ndarray) -> np.ndarray:
    return np.sqrt(np.clip(np.diag(cov), 0.0, None))


def compute_leaderboard(votes: Iterable[Vote], config: LeaderboardConfig | None = None) -> Leaderboard:
    """Leaderboard from scratch; the Elo trend follows the order of `votes`."""
    config = config or LeaderboardConfig()
    state = LeaderboardState(config)
    state.extend(votes)
    return state.leaderboard()


class LeaderboardState:
    """Counts and Elo updated one vote at a time; each `leaderboard()` refits warm-started.

    The count table is the whole state the ratings depend on, so a leaderboard from here
    equals one computed from scratch over the same votes (up to the fit's tolerance, far
    below the digest's rounding).
    """

    def __init__(self, config: LeaderboardConfig | None = None) -> None:
        self.config = config or LeaderboardConfig()
        self._cells: Counter[tuple[str, str, str]] = Counter()
        self._elo = OnlineElo(self.config.elo_k)
        self._beta: dict[str, float] = {}
        self._styled = StyleRows()
        self._by_category: dict[str, Counter[tuple[str, str, str]]] = {}
        self._style_init: tuple[dict[str, float], np.ndarray] | None = None
        self.total = 0

    def add(self, vote: Vote) -> None:
        self._cells[canonical(vote.model_a, vote.model_b, vote.outcome)] += 1
        self._elo.update(vote.model_a, vote.model_b, vote.outcome)
        self.total += 1
        self._styled.add(vote)
        for name in vote.categories:
            self._by_category.setdefault(name, Counter())[canonical(vote.model_a, vote.model_b, vote.outcome)] += 1

    def extend(self, votes: Iterable[Vote]) -> None:
        for v in votes:
            self.add(v)

    def table(self) -> CountTable:
        return CountTable.from_cells(self._cells)

    def leaderboard(self) -> Leaderboard:
        board = build_leaderboard(self.table(), self.config, elo=self._elo.ratings, init=self._beta)
        if isinstance(board.fit, BradleyTerryFit):
            self._beta = dict(zip(board.fit.models, board.fit.beta.tolist(), strict=True))
        return board

    def category_votes(self) -> dict[str, int]:
        """Counted votes per category that has any."""
        return {name: sum(cells.values()) for name, cells in sorted(self._by_category.items())}

    def category_leaderboard(self, name: str) -> Leaderboard | None:
        """The Bradley–Terry board over the votes of one category (no Elo trend); None if it has none."""
        cells = self._by_category.get(name)
        return build_leaderboard(CountTable.from_cells(cells), self.config) if cells else None

    def style_leaderboard(self) -> Leaderboard | None:
        """The style-controlled board over the votes with style counts, warm-started; None if none."""
        board = build_style_leaderboard(self._styled, self.config, elo=self._elo.ratings, init=self._style_init)
        if board is not None and isinstance(board.fit, StyleFit):
            fit = board.fit
            self._style_init = (dict(zip(fit.models, fit.theta.tolist(), strict=True)), fit.gamma)
        return board
