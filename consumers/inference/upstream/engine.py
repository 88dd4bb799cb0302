"""A model's tokens from an OpenAI-compatible server arenaflow does not run (vLLM, SGLang,
TGI, llama-server, Ollama, a hosted API): an :class:`EngineBackend` the runner steps like
the built-in engine, on the streamed engine (``consumers/inference/streamed.py``) that
the llama.cpp backend shares, without a server to start.

The upstream tokenizes: a request goes as its chat messages (`/chat/completions`) or its
text prompt (`/completions`), streamed, with its usage at the end (`stream_options`).
Each streamed delta is a token here (its pieces: `logprobs.Pieces`), so chunks, the
step times admission learns from and the terminal's usage are as for a local model.

A connection refused or broken before the first token, and a 429 or 503 (after its
`Retry-After`), are tried again while the deadline allows; a completions stream that
breaks mid-answer is continued from the text it gave (the prompt and the partial answer),
a chat stream where the entry says its upstream continues a final assistant message
(`continue_chat`: the partial answer sent as that message); any other ends with a clear
error. A request taken over from a dead worker is continued alike, from its stored chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import orjson

from consumers.inference.engine.logprobs import Pieces
from consumers.inference.engine.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, SamplingParams, TokenLogprob
from consumers.inference.engine_io import FinishReason, GenRequest, StepOutput, TextPrompt
from consumers.inference.errors import PermanentError, Unavailable, Unsupported
from consumers.inference.metrics import METRICS
from consumers.inference.model_loading import LoadedModel, ModelSpec
from consumers.inference.streamed import Post, ServerRefused, Stream, StreamedEngine
from consumers.inference.upstream.circuit import Circuit
from consumers.inference.upstream.options import UpstreamOptions
from events.models import FailureCode, PromptAccepted, TokensGenerated

log = logging.getLogger(__name__)

#: The upstream's finish reasons -> the engine's ("content_filter" and the like end it too).
FINISHES: dict[str, FinishReason] = {"stop": "stop", "length": "length", "eos": "stop"}
#: Waits before trying a refused or broken connection again (then the last, over and over).
RETRY_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)
#: A Retry-After longer than this is not waited out here: the request fails as overloaded.
MAX_RETRY_AFTER_S = 30.0


def upstream_request(
    event: PromptAccepted, params: SamplingParams, chunks: list[TokensGenerated], spec: ModelSpec
) -> GenRequest:
    """The engine's request of ``event`` for an upstream: the prompt as text; a request
    taken over from a dead worker carries the text of its stored chunks, to continue.
    Unsupported (the client's 400) where the entry says the upstream cannot serve it."""
    if event.prompt_format == "text":
        prompt = TextPrompt(text=event.messages[-1].content, resumed="".join(c.text for c in chunks))
    else:
        messages = [m.model_dump() for m in event.messages]
        prompt = TextPrompt(messages=messages, resumed="".join(c.text for c in chunks))
    resume_ids = [t for c in chunks for t in c.token_ids]
    req = GenRequest(event.request_id, [], params, event.deadline_at, resume_ids=resume_ids, text_prompt=prompt)
    assert spec.upstream is not None
    check_served(spec.upstream, spec.name, req)
    return req


def check_served(options: UpstreamOptions, name: str, req: GenRequest) -> None:
    """Unsupported, naming the field, for a request ``options`` says the upstream cannot serve."""
    assert req.text_prompt is not None, "an upstream model takes its prompt as text (upstream_request)"
    endpoint = "chat" if req.text_prompt.messages is not None else "completions"
    if endpoint not in options.endpoints:
        served = " and ".join(options.endpoints)
        raise Unsupported("messages" if endpoint == "chat" else "prompt", name, f"its upstream serves {served} only")
    for field in set_fields(req.params):
        if field in options.unsupported:
            raise Unsupported(field, name)
    if req.text_prompt.resumed and endpoint == "chat" and not options.continue_chat:
        # Not the client's fault (no 400): the worker that was answering it died.
        raise PermanentError(
            f"the worker answering it stopped mid-answer, and the upstream of {name} cannot continue a chat "
            "answer (its entry sets no continue_chat)"
        )


def set_fields(p: SamplingParams) -> list[str]:
    """The request fields ``p`` sets away from their defaults, by their API names."""
    named = {
        "seed": p.seed is not None,
        "stop": bool(p.stop),
        "temperature": p.temperature != DEFAULT_TEMPERATURE,
        "top_p": p.top_p != DEFAULT_TOP_P,
        "presence_penalty": p.presence_penalty != 0.0,
        "frequency_penalty": p.frequency_penalty != 0.0,
        "logit_bias": bool(p.logit_bias),
        "logprobs": p.logprobs is not None,
        "ignore_eos": p.ignore_eos,
    }
    return [name for name, on in named.items() if on]


def request_body(options: UpstreamOptions, req: GenRequest, continued: str) -> dict[str, Any]:
    """The OpenAI request of ``req``, streamed with its usage; ``continued``: the answer's
    text so far, which a completions prompt ends with, or a chat's final assistant message
    is (the upstream continues it)."""
    assert req.text_prompt is not None
    p = req.params
    body: dict[str, Any] = {
        "model": options.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": p.max_tokens - len(req.resume_ids),
        "temperature": p.temperature,
        "top_p": p.top_p,
    }
    if p.stop:
        body["stop"] = list(p.stop)
    if p.seed is not None:
        body["seed"] = p.seed
    if p.presence_penalty or p.frequency_penalty:
        body |= {"presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty}
    if p.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in p.logit_bias}
    if p.ignore_eos:
        body["ignore_eos"] = True  # vLLM's, SGLang's and llama-server's extension
    chat = req.text_prompt.messages is not None
    if p.logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": p.logprobs} if chat else {"logprobs": max(1, p.logprobs)}
    if chat:
        body["messages"] = req.text_prompt.messages
        if continued:
            # llama-server continues a final assistant message by itself; vLLM and SGLang
            # when told (llama-server takes their fields too).
            body["messages"] = [*body["messages"], {"role": "assistant", "content": continued}]
            body |= {"continue_final_message": True, "add_generation_prompt": False}
    else:
        body["prompt"] = (req.text_prompt.text or "") + continued
    return body


def delta_logprobs(choice: dict, pieces: Pieces, top: int) -> list[TokenLogprob] | None:
    """A streamed choice's log probabilities (chat's `content` list or completions'
    parallel lists) as the engine's, over ``pieces``; None where it carries none."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    if isinstance(lp.get("content"), list):  # chat
        return [
            TokenLogprob(
                pieces.id(t["token"]),
                float(t["logprob"]),
                tuple((pieces.id(a["token"]), float(a["logprob"])) for a in (t.get("top_logprobs") or ())[:top]),
            )
            for t in lp["content"]
        ]
    tokens, values = lp.get("tokens") or [], lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or [{}] * len(tokens)
    return [
        TokenLogprob(
            pieces.id(t), float(v), tuple((pieces.id(a), float(b)) for a, b in list((alt or {}).items())[:top])
        )
        for t, v, alt in zip(tokens, values, tops, strict=False)
    ]


class UpstreamEngine(StreamedEngine):
    """The engine of a ``backend: upstream`` model: its streams to the upstream server."""

    def __init__(self, loaded: LoadedModel):
        assert loaded.spec.upstream is not None
        self.options = options = loaded.spec.upstream
        super().__init__(loaded, options.concurrency, f"upstream-{loaded.spec.name}")
        key = options.api_key()  # read now: a key rotated in its file is read at the next load
        self._headers = {**options.headers, **({"Authorization": f"Bearer {key}"} if key else {})}
        self._key = key
        self._pieces: Pieces = loaded.tokenizer
        #: Opened by repeated failures: its requests are refused at once meanwhile.
        self.circuit = Circuit()
        self._prober: asyncio.Task | None = None
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=options.connect_timeout_s, sock_read=options.read_timeout_s
        )
        asyncio.run_coroutine_threadsafe(self._open(timeout), self._loop).result(timeout=10)
        self.ready.set()

    async def _open(self, timeout: aiohttp.ClientTimeout) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)

    def _check(self, req: GenRequest) -> None:
        check_served(self.options, self.name, req)
        if not self.circuit.allow():
            raise Unavailable(
                self.name,
                f"its upstream failed {self.circuit.failures_to_open} times or more in a row "
                f"({self.secret_free(self.circuit.last_failure)})",
                self.circuit.retry_in(),
            )

    def secret_free(self, text: str) -> str:
        """``text`` with the API key blotted out, should the upstream echo it."""
        return text.replace(self._key, "[key]") if self._key else text

    # ---- streams (on the engine's loop) --------------------------------------------

    def _request(self, stream: Stream) -> Post | None:
        req = stream.req
        assert req.text_prompt is not None
        left = req.params.max_tokens - len(req.resume_ids) - stream.generated
        if left <= 0:
            return None
        chat = req.text_prompt.messages is not None
        body = request_body(self.options, req, req.text_prompt.resumed + stream.state.get("text", ""))
        body["max_tokens"] = left
        path = "/chat/completions" if chat else "/completions"
        return Post(self.options.base_url + path, body, self._headers)

    async def _read(self, stream: Stream) -> None:
        """The stream, tried again while the deadline allows where that is safe: a refused
        or broken connection before the first token, a 429 or 503 after its Retry-After, a
        stream broken mid-answer that its upstream can continue (`continuable`)."""
        tries = 0
        try:
            while True:
                stream.state["base"] = stream.generated  # what this try's usage does not count
                try:
                    await super()._read(stream)
                    self._told(None)
                    return
                except ServerRefused as exc:
                    if exc.status not in (429, 503):  # the upstream answered: alive, unless it failed
                        self._told(f"it answered {exc.status}" if exc.status >= 500 else None)
                        raise ServerRefused(exc.status, self.secret_free(exc.text), exc.retry_after) from None
                    METRICS.upstream_busy.labels(self.name).inc()  # busy, not failing: the circuit stays
                    wait = retry_after(exc.retry_after, tries)
                    if wait > MAX_RETRY_AFTER_S or not self._time_left(stream.req, wait):
                        raise
                except orjson.JSONDecodeError:  # an event that is no JSON: failing, though it answers
                    self._told("it sent an event that is not JSON")
                    raise
                except (aiohttp.ClientError, OSError) as exc:
                    self._told(f"{type(exc).__name__}")
                    if stream.ended or (stream.generated and not self.continuable(stream.req)) or self.circuit.open:
                        raise
                    wait = RETRY_BACKOFF_S[min(tries, len(RETRY_BACKOFF_S) - 1)]
                    if not self._time_left(stream.req, wait):
                        raise
                tries += 1
                log.warning(
                    "upstream of %s: trying again in %.2f s",
                    self.name,
                    wait,
                    extra={"request_id": stream.req.request_id},
                )
                await asyncio.sleep(wait)
        finally:
            self.circuit.released()  # a probe that said nothing either way (cancelled, its deadline)

    def continuable(self, req: GenRequest) -> bool:
        """Whether the upstream can continue a partial answer of ``req``: a completions
        prompt always can; a chat where the entry says so (`continue_chat`)."""
        return req.text_prompt is None or req.text_prompt.messages is None or self.options.continue_chat

    def _told(self, failure: str | None) -> None:
        """The circuit told of a try's outcome (None: the upstream answered), and the metrics."""
        if failure is None:
            self.circuit.succeeded()
        else:
            METRICS.upstream_failures.labels(self.name).inc()
            self.circuit.failed(failure)
        METRICS.upstream_circuit_open.labels(self.name).set(int(self.circuit.open))
        if self.circuit.open and (self._prober is None or self._prober.done()):
            self._prober = self._loop.create_task(self._probe())

    async def _probe(self) -> None:
        """While the circuit is open: once its cooldown has passed, the half-open probe (the
        upstream's model list, with the key), which closes it or opens it for longer.
        The engine probes itself: the gateways refuse its requests meanwhile."""
        assert self._session is not None
        while self.circuit.open and not self._stopping:
            await asyncio.sleep(max(0.05, self.circuit.retry_in()))
            if not self.circuit.allow():
                continue
            try:
                async with self._session.get(f"{self.options.base_url}/models", headers=self._headers) as r:
                    failure = None if r.status < 500 else f"its model list answered {r.status}"
            except (aiohttp.ClientError, OSError) as exc:
                failure = type(exc).__name__
            if failure is None:
                log.info("upstream of %s answers again: circuit closed", self.name)
            self._told(failure)

    @staticmethod
    def _time_left(req: GenRequest, wait: float) -> bool:
        return req.deadline is None or time.time() + wait < req.deadline

    async def _broken(self, stream: Stream, exc: Exception) -> None:
        self._finish(stream, self._failed(stream, exc))

    def _failed(self, stream: Stream, exc: Exception) -> StepOutput:
        code: FailureCode
        match exc:
            case ServerRefused(status=429 | 503):
                code, message = "overloaded", f"the upstream of {self.name} is busy ({exc.status}); retry"
            case ServerRefused(status=400 | 404 | 413 | 422):
                code, message = "invalid_request", f"the upstream of {self.name} refused it: {exc}"
            case ServerRefused(status=401 | 403):
                code, message = "internal_error", f"the upstream of {self.name} refused its API key ({exc.status})"
            case ServerRefused():
                code, message = "internal_error", f"the upstream of {self.name} failed: {exc}"
            case aiohttp.ClientError() | OSError() if stream.generated:
                code, message = "internal_error", f"the upstream of {self.name} broke off mid-answer: {exc!r}"
            case aiohttp.ClientError() | OSError():
                code, message = "internal_error", f"the upstream of {self.name} cannot be reached: {exc!r}"
            case _:
                code, message = "internal_error", f"the upstream of {self.name} sent what cannot be read: {exc!r}"
        out = self._ended(stream, "error")
        out.failure = (code, self.secret_free(message))
        return out

    def _parsed(self, stream: Stream, data: dict | None) -> StepOutput | None:
        req, state = stream.req, stream.state
        if data is None:  # [DONE]
            return self._last(stream, state.get("reason") or "stop")
        if "error" in data:
            raise RuntimeError(f"upstream error: {data['error']}")
        if usage := data.get("usage"):
            state["usage"] = usage
        choices = data.get("choices") or ()
        if not choices:
            return None
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") or "" if "delta" in choice else choice.get("text") or ""
        if reason := choice.get("finish_reason"):
            state["reason"] = FINISHES.get(reason, "stop")
        if not text:
            return None
        logprobs = None
        if req.params.logprobs is not None:
            logprobs = delta_logprobs(choice, self._pieces, req.params.logprobs)
        ids = [lp.token_id for lp in logprobs] if logprobs else [self._pieces.id(text)]
        stream.generated += len(ids)
        state["text"] = state.get("text", "") + text
        return StepOutput(
            req.request_id,
            ids,
            text,
            False,
            None,
            prompt_tokens=int((state.get("usage") or {}).get("prompt_tokens", 0)),
            completion_tokens=len(req.resume_ids) + stream.generated,
            logprobs=logprobs,
        )

    def _last(self, stream: Stream, reason: FinishReason) -> StepOutput:
        """The stream's end: its usage as the upstream counted it, where it sent one."""
        out = self._ended(stream, reason)
        usage = stream.state.get("usage") or {}
        out.prompt_tokens = int(usage.get("prompt_tokens", 0))
        if "completion_tokens" in usage:
            out.completion_tokens = len(stream.req.resume_ids) + stream.state["base"] + int(usage["completion_tokens"])
        return out


def retry_after(header: str | None, tries: int) -> float:
    """A Retry-After header's seconds (its HTTP-date form read as none), else the backoff."""
    try:
        return max(0.0, float(header)) if header else RETRY_BACKOFF_S[min(tries, len(RETRY_BACKOFF_S) - 1)]
    except ValueError:
        return RETRY_BACKOFF_S[min(tries, len(RETRY_BACKOFF_S) - 1)]
