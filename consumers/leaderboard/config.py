"""Settings of the leaderboard computation (pure data, no environment reading)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from consumers.leaderboard.bradley_terry import FASTCHAT_PRIOR_L2, Gauge
from consumers.leaderboard.settings import MIN_VOTES


class LeaderboardConfig(BaseModel):
    """How a leaderboard is computed from votes; part of its digest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    interval: Literal["sandwich", "bootstrap"] = Field(
        "sandwich",
        description=(
            "Which 95% intervals the rows carry and ranks use. The sandwich is the default: "
            "it needs no random numbers (the digest does not depend on numpy's generator "
            "streams) and costs one matrix inverse, so live updates stay cheap."
        ),
    )
    level: float = Field(0.95, gt=0.0, lt=1.0, description="Coverage of the intervals.")
    bootstrap_rounds: int = Field(100, ge=2, description="Resamples for interval='bootstrap' (FastChat uses 100).")
    seed: int = Field(0, ge=0, description="Seed of the bootstrap's numpy Generator.")
    min_votes: int = Field(
        MIN_VOTES,
        ge=0,
        description=(
            "Models with fewer votes are provisional: flagged, and ranked by their interval's lower bound "
            "(ARENA_MIN_VOTES for the live board)."
        ),
    )
    rating: float = Field(1000.0, description="Mean rating, or the anchor's rating when `anchor` is set.")
    anchor: str | None = Field(None, description="Hold this model at `rating` instead of fixing the mean.")
    l2: float = Field(
        FASTCHAT_PRIOR_L2,
        ge=0.0,
        description=(
            "L2 penalty (a weak Gaussian prior) on natural-log strengths, the same as FastChat's style fit "
            "(reg 0.5 on log10 strengths): a model that won its few votes gets a finite rating and a wide "
            "interval. On connected data its effect is of order l2 / votes. 0 gives the plain MLE."
        ),
    )
    elo_k: float = Field(4.0, gt=0.0, description="K-factor of the online Elo trend (FastChat: 4).")

    @model_validator(mode="after")
    def _check(self) -> LeaderboardConfig:
        if self.anchor == "":
            raise ValueError("anchor is empty; give a model name or leave it unset for the mean-1000 gauge")
        return self

    @property
    def gauge(self) -> Gauge:
        return Gauge(self.rating, self.anchor)
