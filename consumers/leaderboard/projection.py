"""Battle events -> the counted votes -> a leaderboard (pure logic, no broker).

Votes count in stream order: a `VoteCast` adds its vote (the first per battle), a
`VoteInvalidated` takes it out, a `VoteReinstated` puts it back. The live consumer and
`arena leaderboard --at SEQ` both run this fold, so at the same sequence they produce
the same leaderboard and digest.
"""

from __future__ import annotations

import time

from consumers.leaderboard.config import LeaderboardConfig
from consumers.leaderboard.history import ModelHistory
from consumers.leaderboard.ratings import BradleyTerryFit, Leaderboard, LeaderboardState, build_style_leaderboard
from consumers.leaderboard.votes import Vote
from events.arena_readmodel import HISTORY
from events.battles import VoteCast, VoteInvalidated, VoteReinstated
from events.models import EventBase

RAW, STYLE, CATEGORY = "raw", "style", "category:"
"""The stored views: the plain Bradley–Terry board, the style-controlled one, a board per
category ("category:coding") and the history of every model that entered."""


def config_of(settings) -> LeaderboardConfig:
    """The leaderboard's config from the process settings (`LeaderboardSettings`): the live
    consumer and `arena leaderboard` must agree on it, since it is part of the digest."""
    return LeaderboardConfig(min_votes=settings.min_votes, interval=settings.interval)


def row_dict(r) -> dict:
    return {
        "model": r.model,
        "rating": r.rating,
        "ci_low": r.ci_low,
        "ci_high": r.ci_high,
        "rank": r.rank,
        "votes": r.votes,
        "provisional": r.provisional,
        "elo": r.elo,
    }


class VoteProjection:
    def __init__(self, config: LeaderboardConfig | None = None) -> None:
        self.config = config or LeaderboardConfig()
        self.votes: dict[str, tuple[int, Vote]] = {}  # battle -> (seq, vote), every vote cast
        self.invalid: set[str] = set()
        self.state = LeaderboardState(self.config)
        self.history = ModelHistory()
        self.seq = 0
        self._rebuild = False

    def apply(self, event: EventBase, seq: int) -> bool:
        """Take one battle event at stream sequence `seq`; True when the counted votes changed."""
        self.seq = max(self.seq, seq)
        self.history.apply(event, seq)
        match event:
            case VoteCast(battle_id=bid) if bid not in self.votes:
                vote = Vote(
                    event.model_a,
                    event.model_b,
                    event.choice,
                    event.occurred_at.timestamp(),
                    event.voter,
                    event.conv_metadata,
                    tuple(event.categories or ()),
                )
                self.votes[bid] = (seq, vote)
                if bid in self.invalid:
                    return False
                self.state.add(vote)
                return True
            case VoteInvalidated(battle_id=bid) if bid not in self.invalid:
                self.invalid.add(bid)
                self._rebuild = bid in self.votes
                return self._rebuild
            case VoteReinstated(battle_id=bid) if bid in self.invalid:
                self.invalid.discard(bid)
                self._rebuild = bid in self.votes
                return self._rebuild
        return False

    def counted(self) -> list[Vote]:
        return [v for bid, (_, v) in sorted(self.votes.items(), key=lambda kv: kv[1][0]) if bid not in self.invalid]

    def _recount(self) -> None:
        if self._rebuild:  # a vote left or came back: recount in stream order
            self.state = LeaderboardState(self.config)
            self.state.extend(self.counted())
            self._rebuild = False

    def leaderboard(self) -> dict:
        """The current leaderboard as stored for the gateway (with its sequence and digest)."""
        self._recount()
        return self.document(self.state.leaderboard() if self.state.total else None)

    def style_leaderboard(self, category: str | None = None) -> dict:
        """The style-controlled board over the counted votes that carry style counts (of one category)."""
        self._recount()
        if category is None:
            return self.document(self.state.style_leaderboard(), style=True)
        votes = [v for v in self.counted() if category in v.categories]
        return {**self.document(build_style_leaderboard(votes, self.config), style=True), "category": category}

    def category_leaderboard(self, name: str) -> dict:
        """The board over the counted votes of one category."""
        self._recount()
        return {**self.document(self.state.category_leaderboard(name)), "category": name}

    def model_history(self) -> dict:
        """Every model that entered, withdrawn or not, with its counted votes; variants per owner."""
        return self.history.document(self.counted(), self.seq)

    def boards(self) -> dict[str, dict]:
        """Every view the gateway serves, by name: raw, style, one per category with votes, history."""
        raw = {**self.leaderboard(), "categories": self.state.category_votes()}
        views = {RAW: raw, STYLE: self.style_leaderboard(), HISTORY: self.model_history()}
        for name in raw["categories"]:
            views[f"{CATEGORY}{name}"] = self.category_leaderboard(name)
        return views

    def document(self, board: Leaderboard | None, style: bool = False) -> dict:
        body: dict = {
            "seq": self.seq,
            "total_votes": 0 if board is None else board.total_votes,
            "computed_at": time.time(),
            "min_votes": self.config.min_votes,
            "style_control": style,
        }
        if style:
            body["style_coefficients"] = None if board is None else dict(board.style_coefficients or {})
        if board is None:
            return {**body, "digest": None, "rows": []}
        if not style:  # the gateway's consensus test and active sampling read each pair's record
            body["pairs"] = decisive_pairs(board)
        return {**body, "digest": board.digest(), "rows": [row_dict(r) for r in board.rows]}


def decisive_pairs(board: Leaderboard) -> list[list]:
    """[model_x, model_y, x's wins, x's losses, ties and both_bad] per pair that met, x < y."""
    table = board.fit.table if isinstance(board.fit, BradleyTerryFit) else None
    if table is None:
        return []
    return [
        [table.models[i], table.models[j], int(c[0]), int(c[1]), int(c[2] + c[3])]
        for (i, j), c in zip(table.pairs.tolist(), table.counts.tolist(), strict=True)
    ]
