"""The leaderboard process's settings (`arena run leaderboard`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from runtime.settings import CommonSettings

MIN_VOTES = 30
"""Votes below which a model is provisional: the one default of ARENA_MIN_VOTES and LeaderboardConfig."""


class LeaderboardSettings(CommonSettings):
    min_votes: int = Field(MIN_VOTES, ge=0, description="Models with fewer counted votes are flagged provisional.")
    interval: Literal["sandwich", "bootstrap"] = Field("sandwich", description="'sandwich' or 'bootstrap' intervals.")
    refresh_s: float = Field(0.5, gt=0, description="Longest a new vote waits before the leaderboard is refit.")
