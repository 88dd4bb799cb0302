"""Every model that ever entered the arena, folded from the battle events (pure logic).

The public history "The Leaderboard Illusion" (arXiv 2504.20879) asks of an arena: a
model variant that entered stays listed with its votes, withdrawn or not, and how many
variants each owner entered is there to see. A model enters with its first
`BattleStarted` (or, imported, its first `VoteCast`); `ModelWithdrawn` and
`ModelReinstated` change its status; nothing takes it out. The live consumer and
`arena leaderboard --history --at SEQ` run this same fold.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from consumers.leaderboard.votes import Vote
from events.battles import BattleStarted, ModelReinstated, ModelWithdrawn, VoteCast
from events.models import EventBase

ACTIVE, WITHDRAWN = "active", "withdrawn"


@dataclass
class Entry:
    """One model's place in the arena."""

    model: str
    owner: str | None
    entered_seq: int
    entered_at: float
    battles: int = 0
    last_battle_at: float | None = None
    status: str = ACTIVE
    changed_seq: int | None = None
    """Stream sequence of its last withdrawal or reinstatement."""
    changed_at: float | None = None
    reason: str | None = None
    changes: int = 0
    """Status changes so far (the next one's `revision`)."""


class ModelHistory:
    def __init__(self) -> None:
        self.models: dict[str, Entry] = {}

    def enter(self, model: str, owner: str | None, seq: int, at: float) -> Entry:
        entry = self.models.get(model)
        if entry is None:
            entry = self.models[model] = Entry(model, owner, seq, at)
        elif owner is not None:
            entry.owner = owner  # the owner last recorded (imported votes record none)
        return entry

    def apply(self, event: EventBase, seq: int) -> None:
        at = event.occurred_at.timestamp()
        if isinstance(event, BattleStarted):
            for model, owner in ((event.model_a, event.owner_a), (event.model_b, event.owner_b)):
                entry = self.enter(model, owner, seq, at)
                entry.battles += 1
                entry.last_battle_at = at
        elif isinstance(event, VoteCast):
            self.enter(event.model_a, None, seq, at)
            self.enter(event.model_b, None, seq, at)
        elif isinstance(event, ModelWithdrawn | ModelReinstated):
            entry = self.enter(event.model, event.owner, seq, at)
            entry.status = WITHDRAWN if isinstance(event, ModelWithdrawn) else ACTIVE
            entry.changed_seq, entry.changed_at, entry.reason = seq, at, event.reason
            entry.changes += 1

    def withdrawn(self) -> set[str]:
        return {m for m, e in self.models.items() if e.status == WITHDRAWN}

    def document(self, counted: Iterable[Vote], seq: int) -> dict:
        """The history at stream sequence `seq`: a row per model in the order they entered,
        with its counted votes, and the variants per owner; `digest` covers both."""
        votes: Counter[str] = Counter()
        for v in counted:
            votes.update((v.model_a, v.model_b))
        rows = [
            {**asdict(e), "votes": votes[e.model]} for e in sorted(self.models.values(), key=lambda e: e.entered_seq)
        ]
        for row in rows:
            del row["changes"]
        owners: dict[str | None, dict] = {}
        for row in rows:
            o = owners.setdefault(row["owner"], {"owner": row["owner"], "variants": 0, ACTIVE: 0, WITHDRAWN: 0})
            o["variants"] += 1
            o[row["status"]] += 1
        by_owner = sorted(owners.values(), key=lambda o: (-o["variants"], o["owner"] or ""))
        body = {"models": rows, "owners": by_owner}
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
        return {"seq": seq, **body, "digest": digest}
