"""A model's tokens from a `llama-server` child: an :class:`EngineBackend` the runner steps
like the built-in engine (``consumers/inference/protocol.py``).

The worker tokenizes the prompt as for the built-in engine (the same token ids) and
sends the ids to the server's `/completion` with `stream: true`; each streamed token
comes back as a :class:`StepOutput`, so chunks, the terminal event, the ack after it and
a redelivered request's resumption from its stored chunks are the service's, unchanged.
At most ``parallel`` requests are streamed at once (one per slot); the rest wait here, in
order, and their budgets count in admission's estimate as the built-in engine's waiting do.

The streams run on an event loop of the engine's own (a thread): the server's tokens are
queued as they come, and :meth:`LlamaCppEngine.step` returns one server step's worth: it
waits for the next token, then takes what arrives with it (the server sends every slot's
token of a step together). So the runner's step times are the server's, measured as the
built-in engine's are, and admission learns its speed from them; and the worker's loop
is woken once a step, not once a token.

A request leaves by: its last token (EOS, a stop string, its budget), its deadline or a
cancel (the stream is closed; the server notices and frees the slot), or the server's
death ("lost": the service gives it back, to be continued from its chunks, as for a dead
engine process). A server that dies is started again at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from consumers.inference.engine import check_prompt
from consumers.inference.errors import PermanentError, RetryableError
from consumers.inference.llamacpp.options import LlamaCppOptions
from consumers.inference.llamacpp.server import LlamaServer, command
from consumers.inference.models import LoadedModel
from consumers.inference.protocol import EngineStats, FinishReason, GenRequest, StepOutput
from consumers.inference.sampling import SamplingParams, TokenLogprob
from consumers.inference.sources import gguf_file

log = logging.getLogger(__name__)

#: How long a starting server may take to load its model and answer /health.
START_TIMEOUT_S = 120.0
#: The longest wait before starting again a server that failed to start.
RESTART_BACKOFF_MAX_S = 30.0
#: llama-server's stop_type -> the engine's finish reason.
STOPS: dict[str, FinishReason] = {"eos": "stop", "word": "stop", "limit": "length"}
#: How long a step waits for its first token before it returns none (the runner loops).
IDLE_STEP_S = 0.2
#: After a step's first token, how long the rest of that server step's tokens may trail it.
STEP_GATHER_S = 0.002


@dataclass
class _Stream:
    req: GenRequest
    task: asyncio.Task | None = None
    generated: int = 0  # tokens streamed by this server (resumed ones not counted)
    ended: bool = False
    last_token_at: float | None = None  # time.perf_counter() of its last token's arrival


def completion_body(req: GenRequest, context: int) -> dict[str, Any]:
    """The `/completion` request of ``req``: its prompt (and resumed tokens) as ids, its
    sampling as the built-in engine samples (temperature, then top_p; no top_k, min_p or
    repeat penalty of llama.cpp's own defaults), streamed with the token ids."""
    p: SamplingParams = req.params
    ids = req.input_ids
    body: dict[str, Any] = {
        "prompt": ids,
        "n_predict": max(0, min(p.max_tokens - len(req.resume_ids), context - len(ids))),
        "stream": True,
        "return_tokens": True,
        "cache_prompt": req.cache,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "samplers": ["penalties", "temperature", "top_p"],
        "top_k": 0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "repeat_last_n": context,  # presence and frequency penalties count every token, as the built-in engine
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "stop": list(p.stop),
        "ignore_eos": p.ignore_eos,
        "seed": p.seed if p.seed is not None else secrets.randbits(31),
    }
    if p.logit_bias:
        body["logit_bias"] = [[token, bias] for token, bias in p.logit_bias]
    if p.logprobs is not None:
        body["n_probs"] = max(1, p.logprobs)
    return body


def token_logprobs(probs: list[dict], top: int) -> list[TokenLogprob]:
    """llama-server's `probs` of a streamed chunk as the engine's log probabilities."""
    return [
        TokenLogprob(
            token_id=int(p["id"]),
            logprob=float(p["logprob"]),
            top=tuple((int(t["id"]), float(t["logprob"])) for t in p.get("top_logprobs", ())[:top]),
        )
        for p in probs
    ]


def output(
    req: GenRequest,
    generated: int,
    tokens: list[int],
    text: str,
    reason: FinishReason | None,
    logprobs: list[TokenLogprob] | None = None,
) -> StepOutput:
    return StepOutput(
        request_id=req.request_id,
        new_token_ids=tokens,
        new_text=text,
        finished=reason is not None,
        finish_reason=reason,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.resume_ids) + generated,
        logprobs=logprobs if req.params.logprobs is not None else None,
    )


class LlamaCppEngine:
    """The engine of a ``backend: llamacpp`` model: a `llama-server` child and its streams
    (an :class:`~consumers.inference.protocol.EngineBackend`; ``close()`` stops the server)."""

    def __init__(self, loaded: LoadedModel, binary: Path, max_batch_size: int, threads: int = 0):
        options = loaded.spec.llamacpp or LlamaCppOptions()
        self._loaded = loaded
        self.name = loaded.spec.name
        self._slots = options.parallel or max_batch_size
        threads = options.threads or threads or len(os.sched_getaffinity(0))
        argv = command(binary, gguf_file(loaded.spec.path), self.name, 0, self._slots, loaded.context_len, threads)
        port = argv.index("--port")
        self.server = LlamaServer([*argv[:port], *argv[port + 2 :], *options.args], self.name)
        #: Set while the server answers; what is added meanwhile waits.
        self.ready = threading.Event()
        self._outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the two below: changed on the engine's loop, read by stats()
        self._waiting: deque[GenRequest] = deque()
        self._running: dict[str, _Stream] = {}
        self._failure: str | None = None  # why the last start failed, until one succeeds
        #: The server's steps as the streams timed them (`_timed`), until `timed_steps` takes them.
        self._steps: deque[tuple[int, float, bool]] = deque(maxlen=4096)
        self._prefill_ended_at = -math.inf  # the last first token's arrival (time.perf_counter())
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"llama-{self.name}", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._supervisor = asyncio.run_coroutine_threadsafe(self._supervise(), self._loop)

    # ---- the EngineBackend protocol ------------------------------------------------

    @property
    def loaded(self) -> LoadedModel:
        return self._loaded

    @property
    def max_batch_size(self) -> int:
        return self._slots

    def add(self, req: GenRequest) -> None:
        check_prompt(req, self._loaded.context_len)
        if self._failure is not None and not self.ready.is_set():
            raise RetryableError(f"the llama-server of {self.name} is not running ({self._failure}); retrying")
        with self._lock:
            if req.request_id in self._running or any(r.request_id == req.request_id for r in self._waiting):
                raise PermanentError(f"request {req.request_id} is already in the engine")
            self._waiting.append(req)
        self._loop.call_soon_threadsafe(self._pump)

    def cancel(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._cancel, request_id)

    def step(self) -> list[StepOutput]:
        """One server step's outputs: the next token (or end) of any stream, and whatever
        arrives with it; none after IDLE_STEP_S without one."""
        try:
            outputs = [self._outputs.get(timeout=IDLE_STEP_S)]
        except queue.Empty:
            return []
        end = time.perf_counter() + STEP_GATHER_S
        while (left := end - time.perf_counter()) > 0:
            try:
                outputs.append(self._outputs.get(timeout=left))
            except queue.Empty:
                break
        while not self._outputs.empty():
            outputs.append(self._outputs.get_nowait())
        return outputs

    def timed_steps(self) -> list[tuple[int, float, bool]]:
        """The server's steps since the last call, timed by the tokens' arrivals (`_timed`)."""
        steps = []
        while self._steps:
            steps.append(self._steps.popleft())
        return steps

    def wait_packed(self, timeout: float | None = None) -> bool:
        """llama.cpp lays out its own weights when the server loads them: nothing to wait for."""
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
        return EngineStats(running, waiting)

    def close(self) -> None:
        """Stop the server and the engine's loop (from any thread but the engine's)."""
        self._stopping = True
        self.ready.clear()
        self.server.stop()
        self._supervisor.cancel()
        future = asyncio.run_coroutine_threadsafe(self._end_everything(None), self._loop)
        try:
            future.result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    @property
    def pid(self) -> int | None:
        """The server's pid (a new one after a restart)."""
        return self.server.pid

    # ---- the server (on the engine's loop) -----------------------------------------

    async def _supervise(self) -> None:
        """Start the server, and again whenever it dies (backing off while it cannot start).
        On the engine's loop thread, which lives as long as the worker: the server's
        PDEATHSIG follows the thread that started it."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)
        )
        failures = 0
        while not self._stopping:
            try:
                self.server.start()
                await self.server.wait_ready(self._session, START_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - said, and what waits is given back
                failures += 1
                self._failure = str(exc)
                log.error("llama-server of %s cannot start: %s", self.name, exc)
                self.server.stop()
                await self._end_everything("lost")
                await asyncio.sleep(min(RESTART_BACKOFF_MAX_S, 2.0**failures))
                continue
            failures, self._failure = 0, None
            self.ready.set()
            log.info("llama-server of %s ready on port %d", self.name, self.server.port)
            self._pump()
            code = await self.server.wait_exit()
            self.ready.clear()
            if self._stopping:
                return
            log.error(
                "llama-server of %s exited (%s); giving back what it held\n%s", self.name, code, self.server.said()
            )
            await self._end_running("lost")

    async def _end_running(self, reason: FinishReason) -> None:
        """Every running stream closed and ended with ``reason``."""
        with self._lock:
            ended, self._running = [s for s in self._running.values() if not s.ended], {}
        for stream in ended:
            self._finish(stream, output(stream.req, stream.generated, [], "", reason))
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

    # ---- streams (on the engine's loop) --------------------------------------------

    async def _dead_or_alive(self, within_s: float = 2.0) -> None:
        """After a broken stream: wait until the server is seen dead (then nothing more is
        sent to it until the next one answers: a request given back and redelivered at
        once would be sent into the dead one and given back again, delivery after
        delivery), or ``within_s`` passed with it alive."""
        end = time.monotonic() + within_s
        while time.monotonic() < end:
            if not self.server.alive():
                self.ready.clear()
                return
            await asyncio.sleep(0.05)

    def _pump(self) -> None:
        """Start waiting requests while the server answers and has a free slot."""
        with self._lock:
            while self.ready.is_set() and self._waiting and len(self._running) < self._slots:
                req = self._waiting.popleft()
                stream = self._running[req.request_id] = _Stream(req)
                stream.task = self._loop.create_task(self._stream(stream), name=f"llama-{req.request_id}")

    def _cancel(self, request_id: str) -> None:
        with self._lock:
            waiting = next((r for r in self._waiting if r.request_id == request_id), None)
            if waiting is not None:
                self._waiting.remove(waiting)
            stream = self._running.get(request_id)
        if waiting is not None:
            self._outputs.put(StepOutput.ended(waiting, "cancelled"))
        elif stream is not None and not stream.ended:
            self._finish(stream, output(stream.req, stream.generated, [], "", "cancelled"))
            if stream.task is not None:
                stream.task.cancel()  # closes the connection: the server frees the slot

    async def _stream(self, stream: _Stream) -> None:
        req = stream.req
        body = completion_body(req, self._loaded.context_len)
        try:
            if body["n_predict"] == 0:
                self._finish(stream, output(req, 0, [], "", "length"))
                return
            async with asyncio.timeout(None if req.deadline is None else req.deadline - time.time()):
                await self._read(stream, body)
        except TimeoutError:
            self._finish(stream, output(req, stream.generated, [], "", "deadline"))
        except (aiohttp.ClientError, OSError) as exc:  # the server died under it, or is dying
            if not stream.ended:
                log.warning("llama-server stream broke (%r); giving it back", exc, extra={"request_id": req.request_id})
                await self._dead_or_alive()
                self._finish(stream, output(req, stream.generated, [], "", "lost"))
        except asyncio.CancelledError:
            pass  # cancelled, or the server died: its output is out already
        except Exception:  # a refusal or a bug: this request alone fails
            log.exception("llama-server stream failed", extra={"request_id": req.request_id})
            self._finish(stream, output(req, stream.generated, [], "", "error"))
        finally:
            with self._lock:
                if self._running.get(req.request_id) is stream:
                    del self._running[req.request_id]
            self._pump()

    async def _read(self, stream: _Stream, body: dict) -> None:
        req = stream.req
        assert self._session is not None
        async with self._session.post(f"{self.server.url}/completion", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"llama-server answered {response.status}: {(await response.text())[:300]}")
            async for line in response.content:
                if stream.ended:
                    return
                if not line.startswith(b"data: "):
                    continue
                data = orjson.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(f"llama-server: {data['error']}")
                tokens = [int(t) for t in data.get("tokens") or ()]
                stream.generated += len(tokens)
                self._timed(stream, len(tokens))
                logprobs = None
                if req.params.logprobs is not None and data.get("completion_probabilities"):
                    logprobs = token_logprobs(data["completion_probabilities"], req.params.logprobs)
                reason = STOPS.get(data.get("stop_type", ""), "stop") if data.get("stop") else None
                out = output(req, stream.generated, tokens, data.get("content", ""), reason, logprobs)
                if reason is not None:
                    self._finish(stream, out)
                    return
                self._outputs.put(out)
        if not stream.ended:  # the stream ended without its last event: the server went away
            raise aiohttp.ServerDisconnectedError()

    def _timed(self, stream: _Stream, tokens: int) -> None:
        """The server's decode step as this stream saw it: the time since its last token
        (its first token's wait, queue and prefill, is no step), over the tokens that came,
        at the batch the server holds now, marked when another stream's prefill was in it
        (one was waiting for its first token, or got it, since this stream's last token):
        the runner counts those apart, as the built-in engine's steps with newcomers."""
        if not tokens:
            return
        now = time.perf_counter()
        if stream.last_token_at is None:  # its first token: its prefill ended now
            self._prefill_ended_at = now
        else:
            step = (now - stream.last_token_at) / tokens
            prefill = self._prefill_ended_at > stream.last_token_at or any(
                s.last_token_at is None for s in self._running.values()
            )
            self._steps.extend([(len(self._running), step, prefill)] * tokens)
        stream.last_token_at = now

    def _finish(self, stream: _Stream, out: StepOutput) -> None:
        if not stream.ended:
            stream.ended = True
            self._outputs.put(out)
