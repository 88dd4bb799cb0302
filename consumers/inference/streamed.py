"""An engine whose tokens stream from an HTTP server (server-sent events): the part the
llama.cpp backend (its own `llama-server` child) and the upstream backend (any
OpenAI-compatible server) share. An :class:`~consumers.inference.engine_io.EngineBackend`
the runner steps like the built-in engine.

At most ``slots`` requests are streamed at once; the rest wait here, in order, and their
budgets count in admission's estimate as the built-in engine's waiting do. The streams
run on an event loop of the engine's own (a thread): each event's output is queued as it
comes, and :meth:`StreamedEngine.step` returns one server step's worth: it waits for the
next token, then takes what arrives with it (a batching server sends every slot's token
of a step together). So the runner's step times are the server's, measured by the
tokens' arrivals (`_timed`), and admission learns the server's speed from them.

A subclass says what a request is on the wire (`_request`) and what each event of its
stream means (`_parsed`); it may refuse a request (`_check`), hold requests while its
server is away (`ready`, `_unavailable`) and decide what a broken stream means
(`_broken`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson

from consumers.inference.engine_io import EngineStats, FinishReason, GenRequest, StepOutput
from consumers.inference.errors import PermanentError, RetryableError
from consumers.inference.model_loading import LoadedModel

log = logging.getLogger(__name__)

#: How long a step waits for its first token before it returns none (the runner loops).
IDLE_STEP_S = 0.2
#: After a step's first token, how long the rest of that server step's tokens may trail it.
STEP_GATHER_S = 0.002
#: Tokens of one server step reach their streams within this long of each other: another
#: stream's first token this soon after a stream's token ended the same step.
SAME_STEP_S = 0.01
#: After a stream's token, how long before it reads again while its server steps fast
#: (`paces`): what came meanwhile is one output (`merged`). Each token read alone woke
#: three threads of the worker (the stream's, the runner's, the loop's) for one token,
#: and on a 2-core machine that work took the server's cores from it between its steps
#: (one user's tokens/s through the pipeline ~0.88x the same server's sent to
#: directly). A chunk waits at most this long more, within the cadence of a 4-token
#: packet every 80 ms.
READ_EVERY_S = 0.04


def merged(outs: list[StepOutput]) -> StepOutput:
    """Consecutive outputs of one stream as one: their tokens, text and log probabilities
    in order, the last one's end and counts."""
    if len(outs) == 1:
        return outs[0]
    logprobs = None
    if any(o.logprobs is not None for o in outs):
        logprobs = [lp for o in outs for lp in o.logprobs or ()]
    return replace(
        outs[-1],
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outs),
        logprobs=logprobs,
    )


def paces(step_s: float | None) -> bool:
    """Whether a stream whose server steps ``step_s`` reads paced: where two tokens or
    more come within READ_EVERY_S (a slower step brings one a read all the same, and
    pausing the connection would cost two syscalls a token for nothing)."""
    return step_s is not None and step_s <= READ_EVERY_S / 2


async def _paced(transport: asyncio.Transport | None) -> None:
    """READ_EVERY_S with the connection's reading paused (its bytes wait in the kernel's
    buffer rather than waking the loop as they come)."""
    if transport is None or transport.is_closing():
        await asyncio.sleep(READ_EVERY_S)
        return
    transport.pause_reading()
    try:
        await asyncio.sleep(READ_EVERY_S)
    finally:
        if not transport.is_closing():
            transport.resume_reading()


@dataclass
class Stream:
    """One request being streamed (or about to be)."""

    req: GenRequest
    task: asyncio.Task | None = None
    generated: int = 0  # tokens streamed by this server (resumed ones not counted)
    ended: bool = False
    last_token_at: float | None = None  # time.perf_counter() of its last token's arrival
    step_s: float | None = None  # the server's step as its last tokens came (`_timed`)
    #: What a subclass keeps of the stream between events (text so far, a finish reason).
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Post:
    """A request on the wire: where it goes, its JSON body, its headers."""

    url: str
    body: dict[str, Any]
    headers: Mapping[str, str] | None = None


class ServerRefused(Exception):
    """The server answered a request with a status other than 200."""

    def __init__(self, status: int, text: str, retry_after: str | None = None) -> None:
        super().__init__(f"answered {status}: {text[:300]}")
        self.status, self.text, self.retry_after = status, text, retry_after


class StreamedEngine:
    """The streams of one model's server (see the module's docstring)."""

    def __init__(self, loaded: LoadedModel, slots: int, thread: str):
        self._loaded = loaded
        self.name = loaded.spec.name
        self._slots = slots
        #: Set while the server answers; what is added meanwhile waits.
        self.ready = threading.Event()
        self._outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the two below: changed on the engine's loop, read by stats()
        self._waiting: deque[GenRequest] = deque()
        self._running: dict[str, Stream] = {}
        #: The server's steps as the streams timed them (`_timed`), until `timed_steps` takes
        #: them: (batch, seconds a token, tokens, the stream's last token before, this one).
        self._steps: deque[tuple[int, float, int, float, float]] = deque(maxlen=4096)
        #: When first tokens came (time.perf_counter()): each ended a step with a prefill in it.
        self._first_tokens: deque[float] = deque(maxlen=1024)
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread, daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None

    # ---- what a subclass says --------------------------------------------------------

    def _check(self, req: GenRequest) -> None:
        """Raise PermanentError (or a subclass) for a request that can never run."""

    def _unavailable(self) -> str | None:
        """Why a request cannot be taken now (RetryableError), or None."""
        return None

    def _request(self, stream: Stream) -> Post | None:
        """What ``stream`` sends; None when it has no token left to make (it ends: "length")."""
        raise NotImplementedError

    def _parsed(self, stream: Stream, data: dict | None) -> StepOutput | None:
        """The output of one event of the stream (None: the `[DONE]` line), or None for
        an event that carries none; counts what it brings in ``stream.generated``."""
        raise NotImplementedError

    async def _broken(self, stream: Stream, exc: Exception) -> None:
        """The connection broke under ``stream`` (the server died, or is dying): given back."""
        log.warning("%s stream broke (%r); giving it back", self.name, exc, extra={"request_id": stream.req.request_id})
        self._finish(stream, self._ended(stream, "lost"))

    def _ended(self, stream: Stream, reason: FinishReason) -> StepOutput:
        """The last output of ``stream``, ended by ``reason`` without a token more."""
        req = stream.req
        out = StepOutput.ended(req, reason)
        out.completion_tokens = len(req.resume_ids) + stream.generated
        return out

    # ---- the EngineBackend protocol ------------------------------------------------

    @property
    def loaded(self) -> LoadedModel:
        return self._loaded

    @property
    def max_batch_size(self) -> int:
        return self._slots

    def add(self, req: GenRequest) -> None:
        self._check(req)
        if (why := self._unavailable()) is not None:
            raise RetryableError(why)
        with self._lock:
            if req.request_id in self._running or any(r.request_id == req.request_id for r in self._waiting):
                raise PermanentError(f"request {req.request_id} is already in the engine")
            self._waiting.append(req)
        self._loop.call_soon_threadsafe(self._pump)

    def cancel(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._cancel, request_id)

    def step(self) -> list[StepOutput]:
        """One server step's outputs: the next token (or end) of any stream, and whatever
        arrives with it (until every running stream's came); none after IDLE_STEP_S
        without one."""
        try:
            outputs = [self._outputs.get(timeout=IDLE_STEP_S)]
        except queue.Empty:
            return []
        end = time.perf_counter() + STEP_GATHER_S
        while len(outputs) < len(self._running) and (left := end - time.perf_counter()) > 0:
            try:
                outputs.append(self._outputs.get(timeout=left))
            except queue.Empty:
                break
        while not self._outputs.empty():
            outputs.append(self._outputs.get_nowait())
        return outputs

    def timed_steps(self) -> list[tuple[int, float, bool]]:
        """The server's steps timed by the tokens' arrivals (`_timed`) since the last call,
        each marked prefill when another stream's first token ended it (its prompt was in
        that step); those that ended under SAME_STEP_S ago wait for the next call, as a
        first token of the same step may still be on its way."""
        now = time.perf_counter()
        with self._lock:
            firsts = list(self._first_tokens)
        steps = []
        while self._steps and self._steps[0][4] + SAME_STEP_S <= now:
            batch, step, tokens, since, until = self._steps.popleft()
            after = bisect_right(firsts, since + SAME_STEP_S)  # those just after `since` ended its step
            prefill = after < len(firsts) and firsts[after] <= until + SAME_STEP_S
            # a paced read's tokens span several steps: one of them had the newcomer's prefill
            steps.extend([(batch, step, prefill)] + [(batch, step, False)] * (tokens - 1))
        return steps

    def wait_packed(self, timeout: float | None = None) -> bool:
        """The server lays out its own weights: nothing to wait for."""
        return True

    def fail_all(self) -> list[StepOutput]:
        """Never needed by a step that only reads a queue; ends what it holds all the same."""
        future = asyncio.run_coroutine_threadsafe(self._end_everything("error"), self._loop)
        future.result(timeout=10)
        return self.step()

    def stats(self) -> EngineStats:
        with self._lock:
            running = tuple(
                s.req.params.max_tokens - len(s.req.resume_ids) - s.generated for s in self._running.values()
            )
            waiting = tuple(r.params.max_tokens - len(r.resume_ids) for r in self._waiting)
        if not running and not self._outputs.empty():
            # A stream's last output the runner has not stepped yet (one that failed at
            # once: a 500, a refusal): work, else it waits in the queue for the next request.
            running = (0,)
        return EngineStats(running, waiting)

    def close(self) -> None:
        """End what it holds and stop the engine's loop (from any thread but the engine's)."""
        self._stopping = True
        self.ready.clear()
        future = asyncio.run_coroutine_threadsafe(self._end_everything(None), self._loop)
        try:
            future.result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    # ---- on the engine's loop ------------------------------------------------------

    def _open_session(self) -> aiohttp.ClientSession:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        )
        return self._session

    async def _end_running(self, reason: FinishReason) -> None:
        """Every running stream closed and ended with ``reason``."""
        with self._lock:
            ended, self._running = [s for s in self._running.values() if not s.ended], {}
        for stream in ended:
            self._finish(stream, self._ended(stream, reason))
            if stream.task is not None:
                stream.task.cancel()

    async def _end_everything(self, reason: FinishReason | None) -> None:
        """Running and waiting requests ended with ``reason`` (None: closed without a word)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        if reason is not None:
            await self._end_running(reason)
            for req in waiting:
                self._outputs.put(StepOutput.ended(req, reason))
        else:
            with self._lock:
                streams, self._running = list(self._running.values()), {}
            for stream in streams:
                stream.ended = True
                if stream.task is not None:
                    stream.task.cancel()
        if self._stopping and self._session is not None:
            await self._session.close()

    def _pump(self) -> None:
        """Start waiting requests while the server answers and has a free slot."""
        with self._lock:
            while self.ready.is_set() and self._waiting and len(self._running) < self._slots:
                req = self._waiting.popleft()
                stream = self._running[req.request_id] = Stream(req)
                stream.task = self._loop.create_task(self._stream(stream), name=f"stream-{req.request_id}")

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            waiting = next((r for r in self._waiting if r.request_id == request_id), None)
            if waiting is not None:
                self._waiting.remove(waiting)
            stream = self._running.get(request_id)
        if waiting is not None:
            self._outputs.put(StepOutput.ended(waiting, "cancelled"))
        elif stream is not None and not stream.ended:
            self._finish(stream, self._ended(stream, "cancelled"))
            if stream.task is not None:
                stream.task.cancel()  # closes the connection: the server frees the slot

    async def _stream(self, stream: Stream) -> None:
        req = stream.req
        try:
            async with asyncio.timeout(None if req.deadline is None else req.deadline - time.time()):
                await self._read(stream)
        except aiohttp.ClientError as exc:  # the server died under it, or is dying (or fell silent)
            if not stream.ended:
                await self._broken(stream, exc)
        except TimeoutError:
            self._finish(stream, self._ended(stream, "deadline"))
        except OSError as exc:
            if not stream.ended:
                await self._broken(stream, exc)
        except asyncio.CancelledError:
            pass  # cancelled, or the server died: its output is out already
        except Exception as exc:  # a refusal or a bug: this request alone fails
            log.exception("%s stream failed", self.name, extra={"request_id": req.request_id})
            self._finish(stream, self._failed(stream, exc))
        finally:
            with self._lock:
                if self._running.get(req.request_id) is stream:
                    del self._running[req.request_id]
            self._pump()

    def _failed(self, stream: Stream, exc: Exception) -> StepOutput:
        """The last output of a stream that failed with ``exc`` (a subclass may say why)."""
        return self._ended(stream, "error")

    async def _read(self, stream: Stream) -> None:
        """POST the request, and turn its stream's events into the stream's outputs: each
        read takes every event that came since the last one as one output (`merged`), and
        after a token the next read waits READ_EVERY_S, the connection's reading paused
        meanwhile (`_paced`)."""
        assert self._session is not None
        post = self._request(stream)
        if post is None:
            self._finish(stream, self._ended(stream, "length"))
            return
        async with self._session.post(post.url, json=post.body, headers=post.headers) as response:
            if response.status != 200:
                raise ServerRefused(response.status, await response.text(), response.headers.get("Retry-After"))
            transport = response.connection.transport if response.connection is not None else None
            rest = b""
            while True:
                data = await response.content.readany()
                if stream.ended:
                    return
                if data:
                    *lines, rest = (rest + data).split(b"\n")  # `rest`: a line not yet ended
                else:  # the end of the stream: what is left is its last line
                    lines, rest = [rest], b""
                out = self._took(stream, lines)
                if not data or (out is not None and out.finished):
                    break
                if out is not None and out.new_token_ids and paces(stream.step_s):
                    await _paced(transport)
        if not stream.ended:  # the stream ended without its last event: the server went away
            raise aiohttp.ServerDisconnectedError()

    def _took(self, stream: Stream, lines: list[bytes]) -> StepOutput | None:
        """The outputs of a read's lines as one, timed, then queued (or the stream ended
        with it); None if they carried none."""
        outs = []
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            out = self._parsed(stream, None if payload == b"[DONE]" else orjson.loads(payload))
            if out is not None:
                outs.append(out)
                if out.finished:
                    break
        if not outs:
            return None
        out = merged(outs)
        self._timed(stream, len(out.new_token_ids))
        if out.finished:
            self._finish(stream, out)
        else:
            self._outputs.put(out)
        return out

    def _timed(self, stream: Stream, tokens: int) -> None:
        """The server's decode step as this stream saw it: the time since its last token
        (its first token's wait, queue and prefill, is no step), over the tokens that came,
        at the batch the server holds now. `timed_steps` marks those another stream's
        prefill was in, which the runner counts apart, as the built-in engine's steps with
        newcomers."""
        if not tokens:
            return
        now = time.perf_counter()
        if stream.last_token_at is None:  # its first token: a step with its prefill ended now
            with self._lock:
                self._first_tokens.append(now)
        else:
            step = stream.step_s = (now - stream.last_token_at) / tokens
            self._steps.append((len(self._running), step, tokens, stream.last_token_at, now))
        stream.last_token_at = now

    def _finish(self, stream: Stream, out: StepOutput) -> None:
        if not stream.ended:
            stream.ended = True
            self._outputs.put(out)
