"""A battle's state, folded from its events in stream order (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass, field

from events.battles import BattleStarted, BattleTurn, VoteCast, VoteInvalidated, VoteReinstated
from events.models import EventBase


@dataclass
class Battle:
    started: BattleStarted
    turns: list[BattleTurn] = field(default_factory=list)
    vote: VoteCast | None = None
    invalid_reason: str | None = None  # set while the vote is invalidated

    @property
    def battle_id(self) -> str:
        return self.started.battle_id

    def model(self, side: str) -> str:
        return self.started.model_a if side == "a" else self.started.model_b

    @property
    def counted(self) -> bool:
        return self.vote is not None and not self.vote.imported and self.invalid_reason is None


def fold(events: list[EventBase]) -> Battle | None:
    """None when the battle was never started (an imported vote has no battle)."""
    battle: Battle | None = None
    for e in events:
        if isinstance(e, BattleStarted):
            battle = Battle(e)
        elif battle is None:
            continue
        elif isinstance(e, BattleTurn) and e.turn_id == len(battle.turns):
            battle.turns.append(e)
        elif isinstance(e, VoteCast) and battle.vote is None:
            battle.vote = e
        elif isinstance(e, VoteInvalidated):
            battle.invalid_reason = e.reason
        elif isinstance(e, VoteReinstated):
            battle.invalid_reason = None
    return battle
