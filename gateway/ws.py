"""WebSocket chat: `/v1/ws`, one conversation per socket, each turn streamed as frames.

Handshake query: `conv_id` (generated when absent), `model`, and for a reconnect
`resume_request_id` + `last_seq` (the last chunk seq the client holds; -1 for none).
`resume_grace_s` (default 5, at most 60) is how long a request whose client went away
keeps running, waiting for a resume, before it is cancelled.

Frames, server to client: `session` first, then per turn `chunk`s (one per
TokensGenerated event) and `done`, or `error` (OpenAI's error object; the socket stays
open). Client to server: `turn` (and `ping`, answered with `pong`).

The conversation lives in the stream, not in the socket: each turn reads the
conversation's events (`Pipeline.conversation`) and sends the model the last
completed turn's messages, that turn's answer and the new user message. Any socket, on
any gateway, can therefore carry on a conversation, and `arena replay --conv-id` shows
exactly what the model saw. turn_id is the number of completed turns; a turn is sent
with the idempotency key `ws:<conv>:<turn>:<attempt>` (attempt = earlier failed tries of
that turn), so re-sending a turn while it runs attaches to it instead of running twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from events import subjects
from events.models import ChatMessage, new_id
from gateway import errors
from gateway.access import limits_of, not_found, principal_of
from gateway.admission.uvicorn_adapter import WebSocketProtocol
from gateway.conversation import conversation_state
from gateway.edge import FrameError, parse_frame
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.protocol import ChatCompletionRequest, Deadline, Seed, Temperature, Text, Tokens
from gateway.serving import ChatService
from gateway.session import RequestSession, Ticket, usage_of
from gateway.settings import GatewaySettings
from runtime.background import Background
from runtime.redis import REDIS_DOWN

log = logging.getLogger(__name__)

RESUME_GRACE_S = 5.0
MAX_RESUME_GRACE_S = 60.0


class TurnFrame(BaseModel):
    """A user turn; only the new message, the conversation so far is in the stream."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["turn"]
    content: Text = Field(min_length=1)
    system: Text | None = Field(None, description="System message; used only on a conversation's first turn.")
    max_tokens: Tokens | None = None
    temperature: Temperature | None = None
    seed: Seed | None = None
    deadline_s: Deadline | None = None


class Gone(Exception):
    """The client closed the socket."""


@dataclass
class Deps:
    chat: ChatService
    background: Background = field(default_factory=Background)

    def spawn(self, coro) -> None:
        self.background.spawn(coro)


class Session:
    """One socket: reads frames in a task of its own, so a client leaving mid-turn is
    noticed at once and the running turn is stopped."""

    def __init__(self, ws: WebSocket, deps: Deps, conv_id: str, model: str | None, grace_s: float, principal: str):
        self.ws, self.deps, self.conv_id, self.model, self.grace_s = ws, deps, conv_id, model, grace_s
        self.idle_s = deps.chat.settings.ws_idle_timeout_s
        self.principal = principal
        self.limits = limits_of(ws)
        self.token = new_id()  # names this session as a request's holder
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.current: asyncio.Task | None = None
        self.closed = False

    async def send(self, body: dict) -> None:
        if self.closed:
            raise Gone
        try:
            await self.ws.send_text(json.dumps(body, ensure_ascii=False))
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            self.closed = True
            raise Gone from exc

    async def error(self, err: APIError, **ids) -> None:
        await self.send({"type": "error", "status": err.status, **ids, **err.body()})

    async def run(self, first=None) -> None:
        reader = asyncio.create_task(self._read())
        try:
            if first is not None:
                await self._work(first)
            while not self.closed:
                try:  # the idle clock runs between turns only: a turn streams for as long as its deadline
                    text = await asyncio.wait_for(self.inbox.get(), self.idle_s)
                except TimeoutError:
                    METRICS.websocket_idle_closes.inc()
                    await self.ws.close(code=1000, reason=f"idle for {self.idle_s:g} s")
                    break
                if text is None:
                    break
                await self._work(self.handle(text))
        finally:
            reader.cancel()

    async def _read(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self.inbox.put_nowait(message.get("text") or (message.get("bytes") or b"").decode(errors="replace"))
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass
        finally:
            self.closed = True
            if self.current is not None:
                self.current.cancel()
            self.inbox.put_nowait(None)

    async def _work(self, coro) -> None:
        self.current = asyncio.create_task(coro)
        await asyncio.wait({self.current})
        task, self.current = self.current, None
        if task.cancelled() or isinstance(task.exception(), Gone):
            return
        if task.exception() is not None:
            log.error("websocket turn failed", exc_info=task.exception(), extra={"conv_id": self.conv_id})
            with contextlib.suppress(Gone):
                await self.error(APIError(500, f"internal error: {type(task.exception()).__name__}", "internal_error"))

    async def handle(self, text: str) -> None:
        settings = self.deps.chat.settings
        try:
            data = parse_frame(text, settings.max_ws_frame_bytes, settings.max_json_depth)
        except FrameError as exc:
            return await self.error(APIError(400, str(exc), "invalid_json"))
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "ping":
            return await self.send({"type": "pong"})
        if kind != "turn":
            return await self.error(APIError(400, "frame type must be 'turn' or 'ping'", "invalid_value", "type"))
        try:
            frame = TurnFrame.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = errors.loc(first["loc"]) or None
            return await self.error(APIError(400, f"{param}: {first['msg']}", "invalid_value", param))
        await self.turn(frame)

    async def turn(self, frame: TurnFrame) -> None:
        started = time.perf_counter()
        conv = conversation_state(await self.deps.chat.pipeline.conversation(self.conv_id))
        messages = conv.messages or ([ChatMessage(role="system", content=frame.system)] if frame.system else [])
        messages = [*messages, ChatMessage(role="user", content=frame.content)]
        req = ChatCompletionRequest(
            model=self.model,
            messages=[m.model_dump() for m in messages],
            conv_id=self.conv_id,
            turn_id=conv.turn_id,
            stream=True,
            **frame.model_dump(include={"max_tokens", "temperature", "seed", "deadline_s"}, exclude_none=True),
        )
        admission = asyncio.ensure_future(self._admit(req, f"ws:{self.conv_id}:{conv.turn_id}:{conv.attempt}", started))
        try:
            session = await asyncio.shield(admission)
        except APIError as err:
            return await self.error(err, turn_id=conv.turn_id)
        except asyncio.CancelledError:
            admission.add_done_callback(self._abandon)
            raise
        await self.follow(session)

    async def _admit(self, req: ChatCompletionRequest, key: str, started: float) -> RequestSession:
        """Admit and publish in one step that a client leaving cannot cut in half: a
        claimed idempotency key with no request behind it would hang the turn's retry."""
        chat = self.deps.chat
        ticket, event = await chat.admit(req, key, self.principal, self.limits, started)
        await chat.remember(ticket, holder=self.token)
        return await chat.start(ticket, event, leave=self._cancel_later)

    def _abandon(self, admission: asyncio.Future) -> None:
        """The turn's admission went on after its client left: its session ends (`_cancel_later`)."""
        if not admission.cancelled() and admission.exception() is None:
            self.deps.spawn(admission.result().close())

    async def resume(self, request_id: str, last_seq: int) -> None:
        pipeline = self.deps.chat.pipeline
        record = await pipeline.results.pending(request_id) if subjects.is_valid_token(request_id) else None
        if record is None or await pipeline.keys.owner("req", request_id) != self.principal:
            return await self.error(not_found("request", request_id, "resume_request_id"))
        if record["conv_id"] != self.conv_id:
            return await self.error(
                APIError(
                    400,
                    f"request '{request_id}' belongs to another conversation",
                    "invalid_value",
                    "resume_request_id",
                )
            )
        ticket = Ticket(
            request_id, self.conv_id, record["turn_id"], record["model"], record["deadline_at"], attached=True
        )
        await pipeline.keys.hold(request_id, self.token)
        await self.follow(await self.deps.chat.start(ticket, None, after_seq=last_seq, leave=self._cancel_later))

    async def follow(self, session: RequestSession) -> None:
        """Send the request's chunks, then `done` or `error`; a client gone midway leaves
        the request running for the resume grace (`_cancel_later`)."""
        ids = {"request_id": session.ticket.request_id, "turn_id": session.ticket.turn_id}
        async with session:
            async for chunk in session:
                await self.send({"type": "chunk", **ids, "seq": chunk.seq, "text": chunk.text})
            answer = session.answer
            if isinstance(answer, APIError):
                await self.error(answer, **ids)
            else:
                await self.send(
                    {
                        "type": "done",
                        **ids,
                        "model": answer.model,
                        "finish_reason": answer.finish_reason,
                        "usage": usage_of(answer),
                        "text": answer.text,
                    }
                )

    async def _cancel_later(self, ticket: Ticket) -> None:
        """The `leave` of this socket's requests: off the socket's path, cancel the request
        after the resume grace, unless a socket resumed it meanwhile."""
        self.deps.spawn(self._cancel_after_grace(ticket))

    async def _cancel_after_grace(self, ticket: Ticket) -> None:
        await asyncio.sleep(self.grace_s)
        pipeline = self.deps.chat.pipeline
        try:
            resumed = await pipeline.keys.holder(ticket.request_id) != self.token
            if resumed or await pipeline.results.get_result(ticket.request_id):
                return
        except REDIS_DOWN:  # cannot tell whether it was resumed: cancelling is the safe default
            log.warning("cannot check whether the request was resumed", extra={"request_id": ticket.request_id})
        log.info("client gone; cancelling", extra={"request_id": ticket.request_id})
        await pipeline.cancel(ticket.request_id, ticket.conv_id, ticket.turn_id)


def _handshake(ws: WebSocket, settings) -> tuple[dict, APIError | None]:
    q = ws.query_params
    if (refused := ws.scope.get("state", {}).get("access_error")) is not None:
        return {}, refused  # KeyGuard's verdict, answered as a frame
    conv_id = q.get("conv_id")
    if conv_id is not None and not subjects.is_valid_token(conv_id):
        return {}, APIError(400, "conv_id: use 1-128 letters, digits, '_' or '-'", "invalid_value", "conv_id")
    try:
        last_seq = int(q.get("last_seq", "-1"))
        grace = float(q.get("resume_grace_s", RESUME_GRACE_S))
    except ValueError:
        return {}, APIError(400, "last_seq must be an integer and resume_grace_s a number", "invalid_value")
    if last_seq < -1 or not 0 <= grace <= MAX_RESUME_GRACE_S:
        return {}, APIError(
            400, f"last_seq must be >= -1 and resume_grace_s in [0, {MAX_RESUME_GRACE_S:g}]", "invalid_value"
        )
    return {
        "conv_id": conv_id,
        "model": q.get("model"),
        "resume": q.get("resume_request_id"),
        "last_seq": last_seq,
        "grace": grace,
    }, None


def too_many_websockets(limit: int) -> APIError:
    return APIError(503, f"the gateway holds {limit} WebSockets already; retry shortly", "too_many_websockets")


async def _refuse(ws: WebSocket, err: APIError, code: int = 1008) -> None:
    """The error as the socket's one frame, then the close: 1008 (policy) for a request
    that cannot succeed, 1013 (try again later) for a full gateway."""
    await ws.send_text(json.dumps({"type": "error", "status": err.status, **err.body()}))
    await ws.close(code=code)


def router(chat: ChatService, settings: GatewaySettings) -> APIRouter:
    r = APIRouter(tags=["websocket"])
    deps = Deps(chat)

    @r.websocket("/v1/ws")
    async def chat_ws(ws: WebSocket) -> None:
        await ws.accept()
        try:
            if WebSocketProtocol.open > settings.max_websockets:
                await _refuse(ws, too_many_websockets(settings.max_websockets), code=1013)
                return
            args, err = _handshake(ws, settings)
            if err is not None:
                await _refuse(ws, err)
                return
            principal = principal_of(ws)
            conv_id = args["conv_id"]
            if conv_id is None and args["resume"] and subjects.is_valid_token(args["resume"]):
                record = await chat.pipeline.results.pending(args["resume"])
                conv_id = record["conv_id"] if record else None
            if conv_id is not None and await chat.pipeline.keys.owner("conv", conv_id) not in (None, principal):
                await _refuse(ws, not_found("conversation", conv_id, "conv_id"))
                return
            session = Session(ws, deps, conv_id or new_id(), args["model"], args["grace"], principal)
            await session.send(
                {"type": "session", "conv_id": session.conv_id, "model": args["model"] or settings.default_model}
            )
            first = session.resume(args["resume"], args["last_seq"]) if args["resume"] else None
            await session.run(first)
        except Gone:
            pass

    return r
