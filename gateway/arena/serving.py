"""Battles over the ordinary pipeline: both sides are chat requests served by ChatService.

The stream is the record: a battle's state is folded from its events on every call,
so any gateway serves any battle. Model names stay on the server until the vote is
stored: clients see `model_a` / `model_b`, errors are scrubbed of every served name,
and request and conversation ids of the sides (which /v1 and /chat could look up)
are never sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio

from events import decode_terminal, encode, subjects
from events.arena_readmodel import HISTORY, arena_secret, load_leaderboard
from events.battles import BattleStarted, BattleTurn, VoteCast, VoteInvalidated, VoteStatusChanged, battle_filter
from events.models import ChatCompleted, ChatFailed, ChatRequested, Failure, Terminal, new_id
from gateway.arena.categories import categorize
from gateway.arena.features import Answers, answer_texts, style_of, whole_turns
from gateway.arena.identity import SIDES, neutral_name, scrub, side_conv_id, voter_pseudonym
from gateway.arena.integrity import Decision, Integrity, IntegrityConfig, identity_leak, pair_counts, pair_score
from gateway.arena.pairing import NoPair, PairPolicy, active_pair, pair_stats, sample_pair
from gateway.arena.protocol import BattleView, TurnRequest
from gateway.arena.state import Battle, fold
from gateway.conversation import conversation_state, messages_through
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.pipeline import stream_unavailable
from gateway.protocol import ChatCompletionRequest
from gateway.ratelimit import Limits
from gateway.serving import ChatService
from gateway.session import RequestSession, Ticket
from gateway.shapes import sse
from gateway.variants import model_defaults, model_owners
from runtime.jetstream import NATS_DOWN
from runtime.redis import REDIS_DOWN
from runtime.stream import read_events

log = logging.getLogger(__name__)


@dataclass
class Side:
    side: str
    ticket: Ticket
    event: ChatRequested | None  # None when it attached to a running request
    session: RequestSession | None = None


class ArenaService:
    def __init__(self, chat: ChatService, policy: PairPolicy):
        self.chat, self.policy = chat, policy
        self.pipeline = chat.pipeline
        cfg = chat.settings
        self.integrity = Integrity(
            chat.pipeline.results.redis,
            IntegrityConfig(cfg.arena_min_dwell_s, cfg.arena_daily_vote_cap, cfg.arena_prompt_cap),
        )
        self._secret: bytes | None = None

    async def secret(self) -> bytes:
        if self._secret is None:
            try:
                self._secret = await arena_secret(self.pipeline.results.redis)
            except REDIS_DOWN as exc:
                raise APIError(503, "the result store is unavailable; retry shortly", "store_unavailable") from exc
        return self._secret

    def names(self, battle: Battle | None = None) -> set[str]:
        names = set(self.pipeline.fleet().models)
        return names | ({battle.started.model_a, battle.started.model_b} if battle else set())

    def neutral(self, err: APIError, battle: Battle | None = None) -> APIError:
        """The same error with no model name in it."""
        names = self.names(battle)
        param = None if err.param == "model" else err.param
        return APIError(err.status, scrub(err.message, names), err.code, param, err.headers)

    async def publish(self, event) -> bool:
        """Publish a battle event; True when the server already had it (a duplicate)."""
        try:
            ack = await self.pipeline.js.publish(
                subjects.subject_for(event), encode(event), headers={"Nats-Msg-Id": event.dedupe_key()}
            )
        except NATS_DOWN as exc:
            raise stream_unavailable() from exc
        return bool(getattr(ack, "duplicate", False))

    async def load(self, battle_id: str) -> Battle:
        battle = None
        if subjects.is_valid_token(battle_id):
            try:
                battle = fold(await read_events(self.pipeline.js, battle_filter(battle_id)))
            except NATS_DOWN as exc:
                raise stream_unavailable() from exc
        if battle is None:
            raise APIError(404, f"no battle '{battle_id}'", "battle_not_found", "battle_id")
        return battle

    async def load_own(self, battle_id: str, api_key: str | None, address: str | None) -> Battle:
        """The battle, if this voter started it; with API keys on, 404 to anyone else."""
        battle = await self.load(battle_id)
        if self.chat.settings.api_keys and battle.started.voter != voter_pseudonym(
            await self.secret(), api_key, address
        ):
            raise APIError(404, f"no battle '{battle_id}'", "battle_not_found", "battle_id")
        return battle

    # ---- starting --------------------------------------------------------------------

    async def start(self, api_key: str | None, address: str | None) -> Battle:
        fleet = self.pipeline.fleet()
        down = {m for m in fleet.unavailable if fleet.down_everywhere(m)}
        out = await self.withdrawn() | down
        resident = {m for m, insts in fleet.models.items() if insts and m not in out}
        models = [m for m in fleet.models if m not in out]
        owners = model_owners(self.pipeline.live_beats())
        votes, pairs = await self.records()
        policy = self.policy.with_votes(votes, models)
        try:
            if policy.sampling == "active":
                pair = active_pair(policy, models, resident, pairs)
            else:
                pair = sample_pair(policy, models, resident)
        except NoPair as exc:
            raise APIError(
                503, f"not enough models to battle: {exc}{unloaded(models, resident)}", "not_enough_models"
            ) from exc
        event = BattleStarted(
            battle_id=new_id(),
            voter=voter_pseudonym(await self.secret(), api_key, address),
            model_a=pair.model_a,
            model_b=pair.model_b,
            swapped=pair.swapped,
            policy_version=pair.policy_version,
            pair_probability=pair.probability,
            owner_a=owners.get(pair.model_a),
            owner_b=owners.get(pair.model_b),
        )
        await self.publish(event)
        return Battle(event)

    async def withdrawn(self) -> set[str]:
        """Models withdrawn from the arena (`ModelWithdrawn`, as the stored history has folded it):
        served or not, no new battle pairs them."""
        try:
            history = await load_leaderboard(self.pipeline.results.redis, HISTORY) or {}
        except REDIS_DOWN:
            log.warning("pair sampling without the model history: the result store is unavailable")
            return set()
        return {row["model"] for row in history.get("models", []) if row["status"] == "withdrawn"}

    async def records(self) -> tuple[dict[str, int], dict]:
        """Votes per model and each pair's record, from the stored leaderboard (empty when it cannot be read)."""
        if not self.policy.boost_until and self.policy.sampling != "active":
            return {}, {}
        try:
            return pair_stats(await load_leaderboard(self.pipeline.results.redis))
        except REDIS_DOWN:
            log.warning("pair sampling without the leaderboard: the result store is unavailable")
            return {}, {}

    # ---- turns -----------------------------------------------------------------------

    async def terminal(self, request_id: str) -> Terminal | None:
        """The request's terminal event (Redis, else the stream), or None while it runs."""
        try:
            raw = await self.pipeline.results.get_result(request_id)
            if raw is not None:
                return decode_terminal(raw)
        except REDIS_DOWN:
            pass
        return next((e for e in await self.pipeline.history(request_id) if isinstance(e, Terminal)), None)

    async def turn_terminals(self, turn: BattleTurn) -> Answers:
        """The turn's two terminal events (None while a side runs), side a's first."""
        return await self.terminal(turn.request_a), await self.terminal(turn.request_b)

    async def last_whole_turn(self, battle: Battle) -> tuple[ChatCompleted, ChatCompleted] | None:
        """The answers of the last turn both sides answered: where a new turn goes on from (a
        turn one side did not finish is sent again, and neither side's conversation keeps it)."""
        for turn in reversed(battle.turns):
            if whole := whole_turns([await self.turn_terminals(turn)]):
                return whole[0]
        return None

    async def open_turn(
        self, battle: Battle, req: TurnRequest, principal: str, limits: Limits | None = None
    ) -> tuple[int, list[Side]]:
        """Admit and publish both sides of the next turn; errors come back without names."""
        if battle.vote is not None:
            raise APIError(409, "this battle has been voted on; start a new one", "battle_closed")
        if battle.turns and None in await self.turn_terminals(battle.turns[-1]):
            raise APIError(409, "the previous turn is still running", "turn_running")
        n, key = len(battle.turns), await self.secret()
        whole = await self.last_whole_turn(battle)
        sides: list[Side] = []
        try:
            for i, side in enumerate(SIDES):
                conv = side_conv_id(key, battle.battle_id, side)
                history = messages_through(await self.pipeline.conversation(conv), whole[i].request_id) if whole else []
                creq = ChatCompletionRequest(
                    model=battle.model(side),
                    messages=[*(m.model_dump() for m in history), {"role": "user", "content": req.prompt}],
                    conv_id=conv,
                    turn_id=n,
                    stream=True,
                    **({"max_tokens": req.max_tokens} if req.max_tokens else {}),
                )
                ticket, event = await self.chat.admit(creq, None, principal, limits)
                sides.append(Side(side, ticket, event))
                if ticket.attached:
                    raise APIError(409, "this turn is already running", "turn_running")
            a, b = sides
            await self.publish(
                BattleTurn(
                    battle_id=battle.battle_id,
                    turn_id=n,
                    request_a=a.ticket.request_id,
                    request_b=b.ticket.request_id,
                    conv_a=a.ticket.conv_id,
                    conv_b=b.ticket.conv_id,
                )
            )
            for s in sides:
                s.session = await self.chat.start(s.ticket, s.event)
        except APIError as err:
            for s in sides:  # a started side is stopped; a side only admitted is let go
                await (s.session.close() if s.session is not None else self.chat.abandon(s.ticket))
            raise self.neutral(err, battle) from None
        return n, sides

    async def stream_turn(self, battle: Battle, n: int, sides: list[Side]) -> AsyncIterator[str]:
        """SSE: both sides' chunks as they come, each tagged with its side; then [DONE]. A
        client gone first stops both sides (their sessions' exits). A side that ends without
        an answer (refused by its worker, cut at its deadline, failed) stops the other: the
        turn cannot be voted on, so its other answer would only take a place in the batch."""
        queue: asyncio.Queue = asyncio.Queue()
        head = {"object": "arena.battle.chunk", "battle_id": battle.battle_id, "turn_id": n}

        async def pump(s: Side) -> None:
            assert s.session is not None, "start() every side before streaming"
            err: APIError | None = None
            terminal: ChatCompleted | None = None
            try:
                async with s.session:  # closing it gives back the side's queue place
                    async for chunk in s.session:
                        await queue.put((s.side, chunk.text, None, None))
                    if rest := s.session.remainder():
                        await queue.put((s.side, rest, None, None))
                    answer = s.session.answer
                    terminal, err = (None, answer) if isinstance(answer, APIError) else (answer, None)
            except Exception as exc:
                log.error("battle side failed", exc_info=exc, extra={"request_id": s.ticket.request_id})
                err = APIError(500, f"internal error ({type(exc).__name__})", "internal_error")
            await queue.put((s.side, None, terminal, err))

        tasks = [asyncio.create_task(pump(s)) for s in sides]
        ended: set[str] = set()
        try:
            while len(ended) < len(sides):
                side, text, terminal, err = await queue.get()
                body = {**head, "side": side, "model": neutral_name(side)}
                if text is not None:
                    yield sse({**body, "delta": {"content": text}, "finish_reason": None})
                    continue
                ended.add(side)
                if err is None:
                    yield sse({**body, "delta": {}, "finish_reason": terminal.finish_reason})
                else:
                    await self.call_off([other for other in sides if other.side not in ended])
                    yield sse({**body, "delta": {}, "finish_reason": "error", **self.neutral(err, battle).body()})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            with anyio.CancelScope(shield=True):
                await close_turn(sides)

    async def call_off(self, running: list[Side]) -> None:
        """Stop the sides still running of a turn that cannot be whole any more."""
        for s in running:
            await self.chat.cancel(s.ticket)

    # ---- voting ----------------------------------------------------------------------

    async def vote(self, battle: Battle, choice: str) -> Battle:
        if battle.vote is not None:
            if battle.vote.choice == choice:
                return battle  # a retried vote
            raise APIError(409, "this battle already has a vote", "already_voted")
        if not battle.turns:
            raise APIError(409, "no answers to vote on yet; send a turn first", "not_answered")
        answers = await self.answers(battle)
        unfinished(battle, answers[-1])
        prompts = await self.prompts(battle)
        event = VoteCast(
            battle_id=battle.battle_id,
            choice=choice,
            model_a=battle.started.model_a,
            model_b=battle.started.model_b,
            voter=battle.started.voter,
            turns=len(whole_turns(answers)),
            conv_metadata=style_of(answers),
            categories=categorize(prompts),
        )
        if await self.publish(event):  # another request voted first: its vote holds
            return await self.vote(await self.load(battle.battle_id), choice)
        battle.vote = event
        decision = await self.judge(battle, answers, event, prompts)
        if decision.rule:
            invalid = VoteInvalidated(battle_id=battle.battle_id, reason=decision.reason, detector=decision.rule)
            await self.publish(invalid)
            battle.invalid_reason = decision.reason
            for earlier in decision.also:
                await self.invalidate(earlier, decision)
            METRICS.votes_not_counted.labels(decision.rule).inc(1 + len(decision.also))
        return battle

    async def prompts(self, battle: Battle) -> list[str]:
        """The user's turns that both sides answered, in order (side a's conversation)."""
        try:
            events = await self.pipeline.conversation(battle.turns[-1].conv_a)
        except NATS_DOWN as exc:
            raise stream_unavailable() from exc
        return [m.content for m in conversation_state(events).messages if m.role == "user"]

    async def judge(self, battle: Battle, answers: list[Answers], event: VoteCast, prompts: list[str]) -> Decision:
        """Which rule, if any, takes the vote out (gateway.arena.integrity)."""
        defaults = model_defaults(self.pipeline.live_beats())
        names = self.names(battle) | {d.base for d in defaults.values() if d.base}
        finished = max(t.occurred_at for t in answers[-1] if t is not None)  # both, after unfinished()
        found = self.integrity.first(
            identity_leak(answer_texts(answers), names), (event.occurred_at - finished).total_seconds()
        )
        if found is not None:
            return found
        pair, score = pair_score(event.model_a, event.model_b, event.choice)
        try:
            return await self.integrity.tally(
                battle_id=battle.battle_id,
                voter=event.voter or "",
                score=score,
                pair_counts=pair_counts(await load_leaderboard(self.pipeline.results.redis), pair),
                prompts=prompts,
                now=event.occurred_at,
            )
        except (*REDIS_DOWN, *NATS_DOWN) as exc:  # the vote counts; its history rules could not run
            log.warning("vote rules skipped: %s", exc, extra={"battle_id": battle.battle_id})
            METRICS.vote_checks_skipped.inc()
            return Decision(None)

    async def invalidate(self, battle_id: str, decision: Decision) -> None:
        """Take an earlier vote out for `decision` (unless it is out already)."""
        events = await read_events(self.pipeline.js, battle_filter(battle_id))
        changes = [e for e in events if isinstance(e, VoteStatusChanged)]
        if changes and isinstance(changes[-1], VoteInvalidated):
            return
        await self.publish(
            VoteInvalidated(battle_id=battle_id, reason=decision.reason, detector=decision.rule, revision=len(changes))
        )

    async def answers(self, battle: Battle) -> list[Answers]:
        """Each turn's two terminal events (None while a side runs), in turn order."""
        return [await self.turn_terminals(t) for t in battle.turns]


async def close_turn(sides: list[Side]) -> None:
    """Close both sides' sessions (each stops its request when its client left before its end)."""
    for s in sides:
        if s.session is not None:
            await s.session.close()


def unfinished(battle: Battle, last: Answers) -> None:
    """Refuse a vote on a last turn that has not completed, saying what the voter can do."""
    if any(t is None for t in last):
        raise APIError(409, "the last turn is still running: vote once both answers are in", "not_answered")
    ended = [f"side {side}: {_ending(t)}" for side, t in zip(SIDES, last, strict=True) if isinstance(t, Failure)]
    if ended:
        n = len(battle.turns) - 1
        raise APIError(
            409,
            f"turn {n} did not complete ({', '.join(ended)}), so there is nothing whole to vote on: send the "
            f"prompt again (POST /arena/battles/{battle.battle_id}/turns) and vote once both answers are in",
            "turn_incomplete",
        )


def _ending(terminal: Failure) -> str:
    return terminal.code if isinstance(terminal, ChatFailed) else terminal.type


def view(battle: Battle) -> BattleView:
    voted = battle.vote is not None
    return BattleView(
        battle_id=battle.battle_id,
        turns=len(battle.turns),
        state="voted" if voted else "open",
        model_a=battle.started.model_a if voted else neutral_name("a"),
        model_b=battle.started.model_b if voted else neutral_name("b"),
        choice=battle.vote.choice if battle.vote is not None else None,
        counted=battle.counted if voted else None,
        invalid_reason=battle.invalid_reason if voted else None,
    )


def unloaded(models: list[str], resident: set[str]) -> str:
    """What a refused battle adds about models served but not loaded: only a loaded model
    battles, and a model config's others load on their first request (its `warm:` list
    loads them at start)."""
    idle = [m for m in models if m not in resident]
    if not idle:
        return ""
    names = ", ".join(idle)
    return f" ({names} not loaded: a model battles once loaded; the models config's warm: list loads it at start)"
