"""`arena leaderboard [--history]`, `arena battles import|export|invalidate|reinstate`, `arena models
withdraw|reinstate`, `arena replay --battle-id` and the battle half of `arena audit`: the arena's operator
commands, reading the stream."""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from consumers.leaderboard.fastchat_format import dump_battles, load_battles
from consumers.leaderboard.history import WITHDRAWN
from consumers.leaderboard.projection import VoteProjection, config_of
from consumers.leaderboard.settings import LeaderboardSettings
from consumers.leaderboard.votes import Vote
from events import decode
from events.battles import (
    BATTLES_SUBJECT,
    BattleTurn,
    ModelReinstated,
    ModelWithdrawn,
    VoteCast,
    VoteInvalidated,
    VoteReinstated,
    VoteStatusChanged,
    battle_filter,
)
from events.models import EventBase
from gateway.arena.categories import CATEGORIES, categorize
from runtime import jetstream
from runtime.stream import read_events, request_events


async def battle_events(js, upto: int | None = None) -> list[tuple[int, EventBase]]:
    """(stream sequence, event) of every stored battle event, up to `upto` when given."""
    sub = await js.subscribe(BATTLES_SUBJECT, ordered_consumer=True)
    out: list[tuple[int, EventBase]] = []
    try:
        info = await sub.consumer_info()
        left = info.num_pending + info.delivered.consumer_seq
        while left > 0:
            msg = await sub.next_msg(timeout=5.0)
            left -= 1
            seq = msg.metadata.sequence.stream
            if upto is not None and seq > upto:
                break
            out.append((seq, decode(msg.data)))
    finally:
        await sub.unsubscribe()
    return out


def project(events: list[tuple[int, EventBase]]) -> VoteProjection:
    projection = VoteProjection(config_of(LeaderboardSettings()))
    for seq, event in events:
        projection.apply(event, seq)
    return projection


async def leaderboard(
    js, at: int | None, as_json: bool, style_control: bool = False, category: str | None = None
) -> int:
    if category is not None and category not in CATEGORIES:
        print(f"--category: {category!r} is not one of {', '.join(CATEGORIES)}", file=sys.stderr)
        return 2
    projection = project(await battle_events(js, at))
    if style_control:
        board = projection.style_leaderboard(category)
    elif category is not None:
        board = projection.category_leaderboard(category)
    else:
        board = {**projection.leaderboard(), "categories": projection.state.category_votes()}
    board.pop("computed_at")
    if as_json:
        print(json.dumps(board, indent=2))
        return 0
    kind = ("style-controlled  " if style_control else "") + (f"category {category}  " if category else "")
    if not board["rows"]:
        counted = "votes with style counts" if style_control else "votes"
        print(f"{kind}seq {board['seq']}  no {counted} yet: play a battle at /arena")
        return 0
    print(f"{kind}seq {board['seq']}  votes {board['total_votes']}  digest {board['digest']}")
    if style_control:
        coef = board["style_coefficients"] or {}
        print("style coefficients (logit per SD): " + "  ".join(f"{k} {v:+.3f}" for k, v in coef.items()))
    print(f"{'rank':>4}  {'model':<28} {'rating':>8}  {'95% interval':>19}  {'votes':>6}")
    for r in board["rows"]:
        flag = "  provisional" if r["provisional"] else ""
        ci = f"[{r['ci_low']:.1f}, {r['ci_high']:.1f}]"
        print(f"{r['rank']:>4}  {r['model']:<28} {r['rating']:>8.1f}  {ci:>19}  {r['votes']:>6}{flag}")
    return 0


async def history(js, at: int | None, as_json: bool) -> int:
    """`arena leaderboard --history [--at SEQ] [--json]`: every model that entered, withdrawn ones
    included, and the variants per owner, as folded from the stream (at SEQ: as it was then)."""
    doc = project(await battle_events(js, at)).model_history()
    if as_json:
        print(json.dumps(doc, indent=2))
        return 0
    print(f"seq {doc['seq']}  models {len(doc['models'])}  digest {doc['digest']}")
    print(f"{'model':<28} {'owner':<16} {'status':<9} {'votes':>6} {'battles':>7} {'entered':>8}  changed")
    for m in doc["models"]:
        changed = f"seq {m['changed_seq']}: {m['reason']}" if m["changed_seq"] is not None else ""
        owner = m["owner"] or "unknown"
        print(
            f"{m['model']:<28} {owner:<16} {m['status']:<9} {m['votes']:>6} {m['battles']:>7} "
            f"{m['entered_seq']:>8}  {changed}".rstrip()
        )
    print(
        "variants per owner: "
        + ", ".join(f"{o['owner'] or 'unknown'} {o['variants']} ({o['withdrawn']} withdrawn)" for o in doc["owners"])
    )
    return 0


async def set_model_status(js, model: str, withdraw: bool, reason: str) -> int:
    """`arena models withdraw|reinstate --name M --reason R`: the model leaves (or rejoins) the
    arena, published as an event; it stays in the history with its votes either way."""
    projection = project(await battle_events(js))
    entry = projection.history.models.get(model)
    if entry is None:
        known = ", ".join(projection.history.models) or "none yet"
        print(f"model {model!r} never entered the arena (models that did: {known})", file=sys.stderr)
        return 1
    if (entry.status == WITHDRAWN) == withdraw:
        print(f"model {model} is already {entry.status}")
        return 0
    change = ModelWithdrawn if withdraw else ModelReinstated
    await jetstream.publish(js, change(model=model, reason=reason, owner=entry.owner, revision=entry.changes))
    print(f"{change.type_name()}: {model} ({reason}); it stays in the history (arena leaderboard --history)")
    return 0


def imported_votes(path: str) -> list[VoteCast]:
    """A FastChat clean-battle file as VoteCast events marked imported, with stable battle ids;
    categories from each row's user turns (`conversation_a`) when it has them."""
    raw = Path(path).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:16]
    rows = json.loads(raw)
    events = []
    for i, v in enumerate(load_battles(path)):
        extra = {"occurred_at": datetime.fromtimestamp(v.tstamp, UTC)} if v.tstamp is not None else {}
        events.append(
            VoteCast(
                battle_id=f"imp-{digest}-{i}",
                choice=v.outcome,
                model_a=v.model_a,
                model_b=v.model_b,
                voter=v.judge,
                imported=True,
                conv_metadata=None if v.conv_metadata is None else dict(v.conv_metadata),
                categories=row_categories(rows[i]),
                **extra,
            )
        )
    return events


def row_categories(row: dict) -> list[str] | None:
    conversation = row.get("conversation_a")
    if not isinstance(conversation, list):
        return None
    prompts = [t["content"] for t in conversation if isinstance(t, dict) and t.get("role") == "user"]
    return categorize([p for p in prompts if isinstance(p, str)])


async def import_battles(js, path: str) -> int:
    """Publish the file's votes that the stream does not have yet (a re-import adds none)."""
    events = imported_votes(path)
    have = {e.battle_id for _, e in await battle_events(js) if isinstance(e, VoteCast)}
    new = [e for e in events if e.battle_id not in have]
    for e in new:
        await jetstream.publish(js, e)
    old = len(events) - len(new)
    print(f"imported {len(new)} new votes from {path} ({old} of its {len(events)} already in the stream)")
    return 0


async def export_battles(js, out: str | None) -> int:
    votes: list[Vote] = project(await battle_events(js)).counted()
    if out:
        dump_battles(votes, out)
        print(f"wrote {len(votes)} counted votes to {out}", file=sys.stderr)
    else:
        dump_battles(votes, "/dev/stdout")
    return 0


async def set_vote_status(js, battle_id: str, counted: bool, reason: str) -> int:
    """`arena battles invalidate|reinstate BATTLE_ID --reason R`: an operator's decision on
    whether a battle's vote counts, published as an event (the leaderboard follows it)."""
    events = await read_events(js, battle_filter(battle_id))
    if not any(isinstance(e, VoteCast) for e in events):
        print(f"battle {battle_id} has no vote", file=sys.stderr)
        return 1
    changes = [e for e in events if isinstance(e, VoteStatusChanged)]
    if (not changes or isinstance(changes[-1], VoteReinstated)) == counted:
        print(f"the vote of battle {battle_id} already {'counts' if counted else 'does not count'}")
        return 0
    change = VoteReinstated if counted else VoteInvalidated
    await jetstream.publish(js, change(battle_id=battle_id, reason=reason, detector="operator", revision=len(changes)))
    print(f"{change.type_name()}: battle {battle_id} ({reason})")
    return 0


async def replay_battle(js, battle_id: str) -> list:
    """The battle's events, then each turn's two requests' events."""
    events = await read_events(js, battle_filter(battle_id))
    for turn in [e for e in events if isinstance(e, BattleTurn)]:
        events += await request_events(js, turn.request_a)
        events += await request_events(js, turn.request_b)
    return events
