"""The battle half of `arena audit` (pure; no numpy, so every process may import it)."""

from __future__ import annotations

from events.battles import BattleStarted, VoteCast, VoteInvalidated, VoteReinstated
from events.models import EventBase


def audit_battles(events: list[EventBase]) -> dict:
    """Every vote belongs to a started battle (or was imported); no battle has two votes;
    and which votes do not count, by the rule that took them out."""
    started = {e.battle_id for e in events if isinstance(e, BattleStarted)}
    votes: dict[str, int] = {}
    orphans = []
    for e in events:
        if isinstance(e, VoteCast):
            votes[e.battle_id] = votes.get(e.battle_id, 0) + 1
            if not e.imported and e.battle_id not in started:
                orphans.append(e.battle_id)
    several = sorted(b for b, n in votes.items() if n > 1)
    return {
        "battles": len(started),
        "votes": sum(votes.values()),
        "votes_without_battle": sorted(orphans),
        "battles_with_several_votes": several,
        "votes_not_counted": not_counted(events),
    }


def not_counted(events: list[EventBase]) -> dict[str, list[str]]:
    """Battles whose vote does not count now, by the detector of the change that took it out
    (a vote rule's name, or `operator`), in stream order."""
    out: dict[str, str] = {}
    for e in events:
        if isinstance(e, VoteInvalidated):
            out[e.battle_id] = e.detector
        elif isinstance(e, VoteReinstated):
            out.pop(e.battle_id, None)
    by_rule: dict[str, list[str]] = {}
    for battle_id, detector in out.items():
        by_rule.setdefault(detector, []).append(battle_id)
    return dict(sorted(by_rule.items()))
