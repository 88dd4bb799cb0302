"""A model's tokens from a `llama-server` child: an :class:`EngineBackend` the runner steps
like the built-in engine (``consumers/inference/engine_io.py``).

The worker tokenizes the prompt as for the built-in engine (the same token ids) and
sends the ids to the server's `/completion` with `stream: true`; each streamed token
comes back as a :class:`StepOutput`, so chunks, the terminal event, the ack after it and
a redelivered request's resumption from its stored chunks are the service's, unchanged.
At most ``parallel`` requests are streamed at once (one per slot); the streams, their
queue and the step times taken from the tokens' arrivals are the streamed engine's
(``consumers/inference/streamed.py``), which the upstream backend shares.

A request leaves by: its last token (EOS, a stop string, its budget), its deadline or a
cancel (the stream is closed; the server notices and frees the slot), or the server's
death ("lost": the service gives it back, to be continued from its chunks, as for a dead
engine process). A server that dies is started again at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

from consumers.inference.engine.batch import check_prompt
from consumers.inference.engine.sampling import SamplingParams, TokenLogprob
from consumers.inference.engine_io import FinishReason, GenRequest, StepOutput
from consumers.inference.llamacpp.options import LlamaCppOptions
from consumers.inference.llamacpp.server import LlamaServer, command
from consumers.inference.model_loading import LoadedModel
from consumers.inference.sources import gguf_file
from consumers.inference.streamed import Post, Stream, StreamedEngine

log = logging.getLogger(__name__)

#: How long a starting server may take to load its model and answer /health.
START_TIMEOUT_S = 120.0
#: The longest wait before starting again a server that failed to start.
RESTART_BACKOFF_MAX_S = 30.0
#: llama-server's stop_type -> the engine's finish reason.
STOPS: dict[str, FinishReason] = {"eos": "stop", "word": "stop", "limit": "length"}


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


class LlamaCppEngine(StreamedEngine):
    """The engine of a ``backend: llamacpp`` model: a `llama-server` child and its streams
    (an :class:`~consumers.inference.engine_io.EngineBackend`; ``close()`` stops the server)."""

    def __init__(self, loaded: LoadedModel, binary: Path, max_batch_size: int, threads: int = 0):
        options = loaded.spec.llamacpp or LlamaCppOptions()
        super().__init__(loaded, options.parallel or max_batch_size, f"llama-{loaded.spec.name}")
        threads = options.threads or threads or len(os.sched_getaffinity(0))
        argv = command(binary, gguf_file(loaded.spec.path), self.name, 0, self._slots, loaded.context_len, threads)
        port = argv.index("--port")
        self.server = LlamaServer([*argv[:port], *argv[port + 2 :], *options.args], self.name)
        self._failure: str | None = None  # why the last start failed, until one succeeds
        self._supervisor = asyncio.run_coroutine_threadsafe(self._supervise(), self._loop)

    def _check(self, req: GenRequest) -> None:
        check_prompt(req, self._loaded.context_len)

    def _unavailable(self) -> str | None:
        if self._failure is not None and not self.ready.is_set():
            return f"the llama-server of {self.name} is not running ({self._failure}); retrying"
        return None

    def close(self) -> None:
        """Stop the server and the engine's loop (from any thread but the engine's)."""
        self._stopping = True
        self.ready.clear()
        self.server.stop()
        self._supervisor.cancel()
        super().close()

    @property
    def pid(self) -> int | None:
        """The server's pid (a new one after a restart)."""
        return self.server.pid

    # ---- the server (on the engine's loop) -----------------------------------------

    async def _supervise(self) -> None:
        """Start the server, and again whenever it dies (backing off while it cannot start).
        On the engine's loop thread, which lives as long as the worker: the server's
        PDEATHSIG follows the thread that started it."""
        session = self._open_session()
        failures = 0
        while not self._stopping:
            try:
                self.server.start()
                await self.server.wait_ready(session, START_TIMEOUT_S)
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

    # ---- streams (on the engine's loop) --------------------------------------------

    async def _broken(self, stream: Stream, exc: Exception) -> None:
        """After a broken stream: wait until the server is seen dead (then nothing more is
        sent to it until the next one answers: a request given back and redelivered at
        once would be sent into the dead one and given back again, delivery after
        delivery), or 2 s passed with it alive; then give the request back."""
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            if not self.server.alive():
                self.ready.clear()
                break
            await asyncio.sleep(0.05)
        await super()._broken(stream, exc)

    def _request(self, stream: Stream) -> Post | None:
        body = completion_body(stream.req, self._loaded.context_len)
        return Post(f"{self.server.url}/completion", body) if body["n_predict"] > 0 else None

    def _parsed(self, stream: Stream, data: dict | None) -> StepOutput | None:
        if data is None:
            return None
        if "error" in data:
            raise RuntimeError(f"llama-server: {data['error']}")
        req = stream.req
        tokens = [int(t) for t in data.get("tokens") or ()]
        stream.generated += len(tokens)
        logprobs = None
        if req.params.logprobs is not None and data.get("completion_probabilities"):
            logprobs = token_logprobs(data["completion_probabilities"], req.params.logprobs)
        reason = STOPS.get(data.get("stop_type", ""), "stop") if data.get("stop") else None
        return output(req, stream.generated, tokens, data.get("content", ""), reason, logprobs)
