"""Battle events: a blind battle between two models, its turns, and its vote.

A battle lives on `arena.battle.<kind>.<battle_id>`; its chat requests live on their
own request subjects like any other request (`BattleTurn` links them). Model identities
are in these events because the stream is the server's record; the gateway keeps them
from the client until the vote is stored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from events.codec import register
from events.models import BattleEvent, ModelEvent, StatusChange
from events.subjects import BATTLE_PREFIX, STEM_BY_TYPE

Choice = Literal["a", "b", "tie", "both_bad"]

STARTED = f"{BATTLE_PREFIX}.started"
TURN = f"{BATTLE_PREFIX}.turn"
VOTED = f"{BATTLE_PREFIX}.voted"
INVALIDATED = f"{BATTLE_PREFIX}.invalidated"
REINSTATED = f"{BATTLE_PREFIX}.reinstated"
# A model's place in the arena: arena.battle.model.<kind>.<model token> (five tokens, so
# no battle's filter `arena.battle.*.<battle_id>` selects them).
MODEL_WITHDRAWN = f"{BATTLE_PREFIX}.model.withdrawn"
MODEL_REINSTATED = f"{BATTLE_PREFIX}.model.reinstated"
#: Every battle event; the leaderboard's durable reads this.
BATTLES_SUBJECT = f"{BATTLE_PREFIX}.>"


def battle_filter(battle_id: str) -> str:
    """Every event of one battle."""
    return f"{BATTLE_PREFIX}.*.{battle_id}"


@register
class BattleStarted(BattleEvent):
    """A voter was given two anonymous models: `model_a` answers in the left pane, `model_b` in the right."""

    type: Literal["battle.started"] = "battle.started"
    voter: str = Field(description="Keyed hash of the voter's API key or address; never the raw value.")
    model_a: str
    model_b: str
    swapped: bool = Field(description="The random swap put the sampler's second pick on the left.")
    policy_version: str = Field(description="Digest of the sampling policy (weights, boosts, targets, models).")
    pair_probability: float = Field(ge=0.0, le=1.0, description="Probability of this unordered pair under it.")
    # Optional and additive: battles started before owners existed decode unchanged.
    owner_a: str | None = Field(None, description="Who owns model_a (the models config's `owner:`).")
    owner_b: str | None = Field(None, description="Who owns model_b.")


@register
class BattleTurn(BattleEvent):
    """One prompt of the battle, answered by both sides as two ordinary chat requests."""

    type: Literal["battle.turn"] = "battle.turn"
    turn_id: int = Field(ge=0)
    request_a: str
    request_b: str
    conv_a: str = Field(description="Side a's conversation (derived from the battle with a secret key).")
    conv_b: str

    def dedupe_key(self) -> str:
        return f"battle:{self.battle_id}:turn:{self.turn_id}"


@register
class VoteCast(BattleEvent):
    """The voter's verdict. One per battle: its Nats-Msg-Id is the battle's."""

    type: Literal["vote.cast"] = "vote.cast"
    choice: Choice = Field(description="'a' (left won), 'b' (right won), 'tie' or 'both_bad'.")
    model_a: str
    model_b: str
    voter: str | None = None
    turns: int = Field(0, ge=0, description="Turns both sides completed before the vote.")
    imported: bool = Field(False, description="Read from a FastChat clean-battle file, not voted here.")
    conv_metadata: dict[str, Any] | None = Field(
        None,
        description=(
            "The answers' style, in FastChat's clean-battle layout: sum_assistant_{a,b}_tokens (counted by "
            "each model's own tokenizer), header_count_{a,b}, list_count_{a,b}, bold_count_{a,b} (markdown "
            "counts, code blocks left out), turns. Style control reads it; None on votes cast before it existed."
        ),
    )
    categories: list[str] | None = Field(
        None,
        description=(
            "The battle's categories by gateway.arena.categories' deterministic rules over the user's turns "
            "(coding, math, creative_writing, multi_turn, long_query, hard_prompts, a language); the board per "
            "category reads them. None on votes cast before categories existed."
        ),
    )


class VoteStatusChanged(StatusChange, BattleEvent):
    """A change of whether the battle's vote counts. Each change is a fact of its own:
    `revision` counts the changes before it, so a vote invalidated, reinstated and
    invalidated again publishes three events (a retry of one is still deduplicated)."""

    detector: str = Field(description="What decided it: a check's name, or `operator`.")


@register
class VoteInvalidated(VoteStatusChanged):
    """The battle's vote no longer counts (e.g. an answer named its own model)."""

    type: Literal["vote.invalidated"] = "vote.invalidated"


@register
class VoteReinstated(VoteStatusChanged):
    """An invalidated vote counts again."""

    type: Literal["vote.reinstated"] = "vote.reinstated"


class ModelStatusChanged(StatusChange, ModelEvent):
    """A change of whether a model takes part in the arena. The model stays in the public
    history either way (its votes and rating too); `revision` counts the changes before
    it, like a vote's."""

    owner: str | None = Field(None, description="The model's owner as the arena last recorded it.")


@register
class ModelWithdrawn(ModelStatusChanged):
    """The model leaves the arena: no new battle pairs it; it stays listed, marked withdrawn."""

    type: Literal["model.withdrawn"] = "model.withdrawn"


@register
class ModelReinstated(ModelStatusChanged):
    """A withdrawn model takes part again."""

    type: Literal["model.reinstated"] = "model.reinstated"


STEM_BY_TYPE.update(
    {
        BattleStarted.type_name(): STARTED,
        BattleTurn.type_name(): TURN,
        VoteCast.type_name(): VOTED,
        VoteInvalidated.type_name(): INVALIDATED,
        VoteReinstated.type_name(): REINSTATED,
        ModelWithdrawn.type_name(): MODEL_WITHDRAWN,
        ModelReinstated.type_name(): MODEL_REINSTATED,
    }
)

BATTLE_TYPES = (BattleStarted, BattleTurn, VoteCast, VoteInvalidated, VoteReinstated, ModelWithdrawn, ModelReinstated)
