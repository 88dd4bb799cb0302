"""The arena's HTTP API under /arena, and its web pages (static files, no build step)."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from events.arena_readmodel import HISTORY, load_leaderboard
from gateway.access import limits_of, principal_of
from gateway.arena.categories import CATEGORIES
from gateway.arena.pairing import PairPolicy
from gateway.arena.protocol import BattleView, HistoryView, LeaderboardView, TurnRequest, VoteRequest
from gateway.arena.serving import ArenaService, close_turn, view
from gateway.errors import APIError, errors
from gateway.serving import ChatService
from gateway.settings import GatewaySettings
from runtime.redis import REDIS_DOWN

STATIC = Path(__file__).parent / "static"
CSV_FIELDS = ("rank", "model", "rating", "ci_low", "ci_high", "votes", "provisional", "elo")
NO_STORE = {"cache-control": "no-store"}


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:] if auth.startswith("Bearer ") else None


def leaderboard_csv(board: LeaderboardView) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in board.rows:
        writer.writerow(row.model_dump(include=set(CSV_FIELDS)))
    return out.getvalue()


def router(chat: ChatService, settings: GatewaySettings) -> APIRouter:
    policy = PairPolicy(
        settings.arena_weights,
        tuple(settings.arena_boost),
        settings.arena_targets,
        settings.arena_boost_until_votes,
        settings.arena_sampling,
    )
    arena = ArenaService(chat, policy)
    r = APIRouter(prefix="/arena", tags=["arena"])

    async def stored_view(name: str) -> dict | None:
        try:
            return await load_leaderboard(chat.pipeline.results.redis, name)
        except REDIS_DOWN as exc:
            raise APIError(503, "the result store is unavailable; retry shortly", "store_unavailable") from exc

    async def load(battle_id: str, request: Request):
        return await arena.load_own(battle_id, _api_key(request), request.client.host if request.client else None)

    @r.post("/battles", response_model=BattleView, status_code=201, responses=errors(503))
    async def start_battle(request: Request) -> BattleView:
        """Start a blind battle between two served models, drawn by the pair sampling policy."""
        client = request.client.host if request.client else None
        return view(await arena.start(_api_key(request), client))

    @r.post(
        "/battles/{battle_id}/turns",
        responses={200: {"content": {"text/event-stream": {}}}, **errors(400, 404, 409, 429, 503)},
    )
    async def battle_turn(battle_id: str, body: TurnRequest, request: Request) -> StreamingResponse:
        """Both models answer the prompt, streamed together as server-sent events.

        Each event is `{"object": "arena.battle.chunk", "battle_id", "turn_id", "side": "a"|"b",
        "model": "model_a"|"model_b", "delta": {"content"}, "finish_reason"}` (an `error` object
        with `finish_reason: "error"` when a side failed), and the stream ends with `[DONE]`.
        Each side keeps its own conversation, so later turns see that side's earlier answers."""
        battle = await load(battle_id, request)
        n, sides = await arena.open_turn(battle, body, principal_of(request), limits_of(request))
        # The background close also runs when the client left before the body started.
        return StreamingResponse(
            arena.stream_turn(battle, n, sides),
            media_type="text/event-stream",
            headers=NO_STORE,
            background=BackgroundTask(close_turn, sides),
        )

    @r.post("/battles/{battle_id}/vote", response_model=BattleView, responses=errors(400, 404, 409, 503))
    async def vote(battle_id: str, body: VoteRequest, request: Request) -> BattleView:
        """Store the vote and reveal both models. 409 until both sides of the last turn completed."""
        return view(await arena.vote(await load(battle_id, request), body.choice))

    @r.get("/battles/{battle_id}", response_model=BattleView, responses=errors(404, 503))
    async def get_battle(battle_id: str, request: Request) -> BattleView:
        """The battle; its models are named only once its vote is stored."""
        return view(await load(battle_id, request))

    @r.get(
        "/leaderboard",
        response_model=LeaderboardView,
        responses={200: {"content": {"text/csv": {}}}, **errors(400, 503)},
    )
    async def leaderboard(
        format: str = Query("json", pattern="^(json|csv)$"),
        style_control: bool = Query(False, description="The style-controlled board (length and markdown out)."),
        category: str | None = Query(
            None,
            description=f"The board of one category: {', '.join(CATEGORIES)}.",
            json_schema_extra={"enum": list(CATEGORIES)},
        ),
    ):
        """The current leaderboard (kept live by the leaderboard consumer); `?format=csv` for CSV,
        `?style_control=true` for ratings with the answers' style taken out, `?category=coding`
        for the votes of one category."""
        view = "style" if style_control else "raw"
        if category is not None:
            if category not in CATEGORIES:
                raise APIError(
                    400, f"category: {category!r} is not one of {list(CATEGORIES)}", "invalid_value", "category"
                )
            if style_control:
                raise APIError(400, "category: not available with style_control yet", "invalid_value", "category")
            view = f"category:{category}"
        stored = await stored_view(view)
        empty = {"seq": 0, "style_control": style_control, "category": category}
        board = LeaderboardView.model_validate(stored or empty)
        if format == "csv":
            return Response(leaderboard_csv(board), media_type="text/csv", headers=NO_STORE)
        return Response(board.model_dump_json(), media_type="application/json", headers=NO_STORE)

    @r.get("/history", response_model=HistoryView, responses=errors(503))
    async def history() -> Response:
        """Every model that ever entered the arena, in the order they entered, with its owner and
        counted votes, withdrawn ones included (marked, with the operator's reason), and how many
        variants each owner entered. `served` says whether an inference process serves it now."""
        stored = await stored_view(HISTORY) or {"seq": 0}
        served = set(chat.pipeline.fleet().models)
        for row in stored.get("models", []):
            row["served"] = row["model"] in served
        return Response(
            HistoryView.model_validate(stored).model_dump_json(), media_type="application/json", headers=NO_STORE
        )

    @r.get("", include_in_schema=False)
    async def battle_page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @r.get("/board", include_in_schema=False)
    async def board_page() -> FileResponse:
        return FileResponse(STATIC / "leaderboard.html")

    @r.get("/static/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        path = STATIC / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise APIError(404, f"no file '{name}'", "not_found")
        return FileResponse(path)

    return r
