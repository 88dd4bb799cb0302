"""Request and response bodies of the arena API (they document it in OpenAPI)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from events.battles import Choice
from gateway.protocol import Text, Tokens


class TurnRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Text = Field(min_length=1, description="The user's message; both models answer it.")
    max_tokens: Tokens | None = Field(None, description="Default: the model's own default.")


class VoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    choice: Choice = Field(description="'a' (left is better), 'b' (right), 'tie' or 'both_bad'.")


class BattleView(BaseModel):
    """A battle as its voter sees it: model names only once the vote is stored."""

    battle_id: str
    turns: int = Field(description="Turns started so far.")
    state: Literal["open", "voted"]
    model_a: str = Field(description="'model_a' until the vote is stored, then the real name.")
    model_b: str
    choice: Choice | None = None
    counted: bool | None = Field(None, description="After the vote: does it count on the leaderboard?")
    invalid_reason: str | None = None


class LeaderboardRowView(BaseModel):
    model: str
    rating: float
    ci_low: float
    ci_high: float
    rank: int
    votes: int
    provisional: bool
    elo: float | None = None


class StyleCoefficients(BaseModel):
    """Logit change of P(a wins) per standard deviation of each style feature, (a - b) / (a + b + 1)."""

    length: float = Field(description="Answer length in tokens.")
    header: float = Field(description="Markdown headers.")
    list: float = Field(description="Markdown list items.")
    bold: float = Field(description="Bold spans.")


class LeaderboardView(BaseModel):
    seq: int = Field(description="Stream sequence the leaderboard was computed at (0: no votes yet).")
    digest: str | None = Field(None, description="Leaderboard.digest(): equal for the same votes and config.")
    total_votes: int = 0
    computed_at: float | None = None
    min_votes: int | None = Field(None, description="Rows with fewer votes are provisional.")
    style_control: bool = Field(False, description="Ratings with the answers' style taken out (FastChat's).")
    style_coefficients: StyleCoefficients | None = Field(None, description="Set on the style-controlled board.")
    category: str | None = Field(None, description="The category this board counts the votes of (all when None).")
    categories: dict[str, int] = Field(
        default_factory=dict, description="On the board of all votes: counted votes per category that has any."
    )
    rows: list[LeaderboardRowView] = Field(default_factory=list)


class HistoryRowView(BaseModel):
    """One model that entered the arena. Rows are never removed: a withdrawn model keeps its row."""

    model: str
    owner: str | None = Field(description="The models config's `owner:` when it last battled; None: imported only.")
    status: Literal["active", "withdrawn"] = Field(description="From the stream: withdrawn by `arena models withdraw`.")
    served: bool = Field(description="An inference process serves it now (false: removed from the serving config).")
    votes: int = Field(description="Its counted votes (as on the leaderboard).")
    battles: int = Field(description="Battles started here with it (imported votes have none).")
    entered_seq: int = Field(description="Stream sequence of its first battle or vote.")
    entered_at: float
    last_battle_at: float | None = None
    changed_seq: int | None = Field(None, description="Stream sequence of its last withdrawal or reinstatement.")
    changed_at: float | None = None
    reason: str | None = Field(None, description="The operator's reason for that change.")


class OwnerView(BaseModel):
    owner: str | None
    variants: int = Field(description="Models of this owner that ever entered, withdrawn ones included.")
    active: int
    withdrawn: int


class HistoryView(BaseModel):
    seq: int = Field(description="Stream sequence the history was folded at (0: nothing yet).")
    digest: str | None = Field(None, description="Equal for the same events: `arena leaderboard --history --at SEQ`.")
    models: list[HistoryRowView] = Field(default_factory=list)
    owners: list[OwnerView] = Field(default_factory=list)
