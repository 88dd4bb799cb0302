"""Settings of the leaderboard computation (pure data, no environment reading)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from consumers.leaderboard.bradley_terry import Gauge


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
        300, ge=0, description="Models with fewer votes are flagged provisional (their intervals are wide)."
    )
    rating: float = Field(1000.0, description="Mean rating, or the anchor's rating when `anchor` is set.")
    anchor: str | None = Field(None, description="Hold this model at `rating` instead of fixing the mean.")
    l2: float = Field(
        1e-6,
        ge=0.0,
        description="Ridge on natural-log strengths; keeps a model that never lost finite. 0 disables it.",
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
