"""A stepping batch engine: many generation requests share one padded forward pass.

The engine is synchronous and single-threaded by design: the consumer drives
:meth:`BatchEngine.step` from one dedicated thread and feeds it with the thread-safe
:meth:`BatchEngine.add` / :meth:`BatchEngine.cancel`; the event loop never runs torch.

Batch layout. Running sequences are left-padded to a common length ``T`` in a
preallocated KV cache written in place (:class:`~consumers.inference.engine.kvcache.KVSlab`:
``[rows, heads, columns, head_dim]`` per layer, a ``mask`` marking real tokens), and
each sequence keeps its own absolute position, passed as ``position_ids`` (so padding
never shifts RoPE). Newcomers are prefilled as their own padded batch and written into
the free rows; a finished row is replaced by the batch's last row, and leading
all-padding columns are dropped.

Poison isolation. One bad request must never end its neighbours. Token selection is per
row (a row that cannot be sampled ends alone with "error"), and a forward pass that
raises is re-run on halves of its rows, down to single rows, so only the rows that fail
on their own end with "error"; the others keep the results of the parts that ran, and
since every row's tokens are independent of its batch, they are the tokens they would
have had without the poison.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from consumers.inference.config import EngineConfig
from consumers.inference.engine import lean as lean_decode
from consumers.inference.engine import packed, prepack
from consumers.inference.engine.kvcache import KV, KVSlab, bytes_per_token
from consumers.inference.engine.prefix import Hit, PrefixCache
from consumers.inference.engine.sampling import (
    TextTracker,
    TokenLogprob,
    draw_uniforms,
    make_generator,
    pick_tokens,
    token_logprobs,
)
from consumers.inference.errors import ContextExceeded, KVBudgetExceeded, PermanentError, PromptTooLong
from consumers.inference.models import LoadedModel
from consumers.inference.protocol import EngineStats, FinishReason, GenRequest, StepOutput

log = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass
class _Seq:
    req: GenRequest
    max_tokens: int
    generator: torch.Generator | None
    tracker: TextTracker
    tokens: list[int]
    next_pos: int  # position id of the next token fed to the model
    prefix: Hit | None = None  # keys and values of its first tokens, from the prefix cache

    def output(
        self, new: list[int], text: str, reason: FinishReason | None, logprobs: list[TokenLogprob] | None = None
    ) -> StepOutput:
        if reason is not None and reason != "error":  # a failed row's tracker may be what broke
            text += self.tracker.flush()
        return StepOutput(
            request_id=self.req.request_id,
            new_token_ids=new,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(self.req.prompt_ids),
            completion_tokens=len(self.tokens),
            logprobs=logprobs if self.req.params.logprobs is not None else None,
        )


def check_prompt(req: GenRequest, context_len: int) -> None:
    """Raise ``PromptTooLong`` / ``PermanentError`` if ``req`` can never run in a context of
    ``context_len`` tokens; a request resumed at the end of the context is cut to fit."""
    n = len(req.prompt_ids)
    if n == 0:
        raise PermanentError(f"request {req.request_id}: the prompt is empty")
    if n >= context_len:
        raise PromptTooLong(n, context_len)
    if len(req.input_ids) >= context_len:
        req.resume_ids = req.resume_ids[: context_len - n]


def check_room(req: GenRequest, context_len: int) -> None:
    """Raise ``ContextExceeded`` if ``req``'s prompt and ``max_tokens`` are over the
    context: a request as the client sent it, refused rather than cut short (the engine
    clamps only a resumed one, whose client was answering already)."""
    if len(req.prompt_ids) + req.params.max_tokens > context_len:
        raise ContextExceeded(len(req.prompt_ids), req.params.max_tokens, context_len)


def kv_room(loaded: LoadedModel, budget_bytes: int | None) -> int | None:
    """The tokens (prompt and completion) one request's keys and values may take in a KV
    cache of ``budget_bytes`` (None: no budget), at most the model's context."""
    if budget_bytes is None or loaded.model is None:  # no model here: llama.cpp sizes its own cache
        return None
    return min(loaded.context_len, budget_bytes // bytes_per_token(loaded.model))


def check_kv(req: GenRequest, loaded: LoadedModel, budget_bytes: int | None) -> None:
    """Raise ``KVBudgetExceeded`` if ``req`` alone could never fit the KV cache budget."""
    room = kv_room(loaded, budget_bytes)
    if room is not None and room < loaded.context_len and len(req.prompt_ids) + req.params.max_tokens > room:
        raise KVBudgetExceeded(len(req.prompt_ids), req.params.max_tokens, room, (budget_bytes or 0) / 2**20)


class BatchEngine:
    """Generates for many requests of one model, one token per request per step.

    ``mode="continuous"``: waiting requests join the running batch at every step and
    finished ones leave it. ``mode="static"``: waiting requests are admitted only when
    the running batch is empty, so each micro-batch runs to completion together.

    A prompt that leaves no room in the context raises :class:`PromptTooLong` at
    :meth:`add`; otherwise ``max_tokens`` is clamped to the room left in the context
    (the request then finishes with ``"length"``).

    ``kv_budget_bytes`` bounds the KV slab: a waiting request joins the batch only while
    every row at its longest (prompt and whole token budget, the slab being left-padded to
    its longest row) fits the budget; a lone request always runs (:func:`check_kv` refuses
    one that could never fit before it is queued).

    ``prefix_cache_bytes`` > 0: finished sequences' keys and values are kept (up to that
    many bytes, :mod:`~consumers.inference.engine.prefix`), and a new request whose prompt
    starts with one's tokens prefills only the rest: in the running batch's packed pass
    where there is one (its new tokens attend over the cached keys and values there), else
    in a pass of its own. A request resumed from another worker's chunks prefills cold.

    ``pack_in_background``: the linear layers (prepack.py) are packed on a thread while
    the engine steps its row-major weights, and put in place between two steps
    (``packing_done``; ``on_packed`` is called then): an engine process that replaces a
    dead one serves at once instead of after seconds of packing (SmolLM2's float16 copy:
    ~3 s on a 2-core Xeon).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        mode: Literal["static", "continuous"],
        max_batch_size: int = 32,
        clock: Callable[[], float] = time.time,
        pack: bool | None = None,
        kv_budget_bytes: int | None = None,
        prefix_cache_bytes: int = 0,
        pack_in_background: bool = False,
        on_packed: Callable[[], None] | None = None,
        lean: bool | None = None,
    ) -> None:
        if mode not in ("static", "continuous"):
            raise ValueError(f"mode must be 'static' or 'continuous', got {mode!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.loaded = loaded
        self.mode = mode
        self.max_batch_size = max_batch_size
        self._clock = clock
        self._model = loaded.model
        self._device = next(self._model.parameters()).device
        self._step_lock = threading.Lock()  # a step, or the packed layers going in place
        self._packed = threading.Event()
        self._on_packed = on_packed
        packing = prepack.wanted(loaded.spec, self._model)  # this process's copy (prepack.py)
        if packing and pack_in_background:
            threading.Thread(target=self._pack, args=(packing,), name="engine-pack", daemon=True).start()
        else:
            if packing:
                count = prepack.prepack_model(self._model, packing)
                log.info("%s: %d linear layers packed, %s weights", loaded.spec.name, count, packing)
            elif loaded.spec.prepack and (found := prepack.weight_first_head(self._model, self._device.type)):
                log.info("%s: %s", loaded.spec.name, found)
            self._packed.set()
        self._eos = set(loaded.eos_ids)
        pad = loaded.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else (loaded.eos_ids[0] if loaded.eos_ids else 0)
        params = inspect.signature(self._model.forward).parameters
        # transformers 5.x renames past_key_values to cache (the old name is deprecated).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_last = "logits_to_keep" in params
        #: A step that decodes and admits newcomers runs as one packed pass (packed.py);
        #: ``pack=None``: where that pays (packed.worth_packing).
        wanted = packed.worth_packing(self._model) if pack is None else pack
        self.packed = mode == "continuous" and self._keep_last and wanted and packed.enable(self._model)
        #: The whole batch's decode steps skip transformers' forward (lean.py), for a
        #: packing engine's Llama; ``lean=False``: always through it.
        self.lean = self.packed and lean is not False and lean_decode.supported(self._model)
        self._lock = threading.Lock()
        self._waiting: deque[GenRequest] = deque()
        self._cancelled: set[str] = set()
        self._active: dict[str, GenRequest] = {}  # added and not yet finished, wherever they are
        self._seqs: list[_Seq] = []  # the running batch, in the KV cache's row order
        self._kv = KVSlab(max_batch_size)
        self._kv_budget = kv_budget_bytes
        self._token_bytes = bytes_per_token(self._model) if kv_budget_bytes is not None else 0
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self._hits: dict[str, Hit] = {}  # admitted requests' prefix hits, until their prefill

    @classmethod
    def configured(cls, loaded: LoadedModel, config: EngineConfig, **kwargs: Any) -> BatchEngine:
        """An engine for ``loaded`` as the worker's :class:`EngineConfig` says; ``kwargs``:
        the rest of :meth:`__init__`'s (an engine process packs in the background)."""
        return cls(
            loaded,
            config.mode,
            config.max_batch_size,
            kv_budget_bytes=config.kv_budget_bytes,
            prefix_cache_bytes=config.prefix_cache_bytes,
            **kwargs,
        )

    def _pack(self, packing: prepack.Packing) -> None:
        """On a thread: pack the linear layers while the engine steps, then put them in
        place between two steps."""
        t0 = time.perf_counter()
        try:
            layers = prepack.pack_layers(self._model, packing)
        except Exception as exc:  # noqa: BLE001 - it steps row-major weights, as unpacked
            log.error("%s: packing failed, the row-major weights stay: %r", self.loaded.spec.name, exc)
            return
        with self._step_lock:
            count = prepack.install(layers)
            self._packed.set()
        log.info(
            "%s: %d linear layers packed, %s weights, in %.1fs while serving",
            self.loaded.spec.name,
            count,
            packing,
            time.perf_counter() - t0,
        )
        if self._on_packed is not None:
            self._on_packed()

    @property
    def packing_done(self) -> bool:
        """Whether its layers are as it steps them (its packing, if any, done and in place)."""
        return self._packed.is_set()

    def wait_packed(self, timeout: float | None = None) -> bool:
        return self._packed.wait(timeout)

    # ---- thread-safe producer side -------------------------------------------------

    def add(self, req: GenRequest) -> None:
        """Queue ``req``; raises ``PromptTooLong`` / ``PermanentError`` if it can never run."""
        check_prompt(req, self.loaded.context_len)
        with self._lock:
            if req.request_id in self._active:
                raise PermanentError(f"request {req.request_id} is already in the engine")
            self._active[req.request_id] = req
            self._waiting.append(req)

    def cancel(self, request_id: str) -> None:
        """Finish ``request_id`` with "cancelled" at the next step (unknown ids are ignored)."""
        with self._lock:
            if request_id in self._active:
                self._cancelled.add(request_id)

    # ---- stepping (one thread) -----------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._seqs)

    def budgets(self) -> tuple[list[int], list[int]]:
        """Token budgets left: of each running request, and of each waiting one in order
        (upper bounds: a request may stop early). Read from any thread; approximate."""
        with self._lock:
            waiting = [req.params.max_tokens - len(req.resume_ids) for req in self._waiting]
        running = [seq.max_tokens - len(seq.tokens) for seq in list(self._seqs)]
        return running, waiting

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> EngineStats:
        running, waiting = self.budgets()
        prefix = self.prefix.stats if self.prefix is not None else None
        return EngineStats(tuple(running), tuple(waiting), prefix, self.packing_done)

    def has_work(self) -> bool:
        return bool(self._seqs) or bool(self._waiting)

    def step(self) -> list[StepOutput]:
        """Run one decode step for running requests and one prefill of admitted ones."""
        outputs: list[StepOutput] = []
        with self._step_lock, torch.inference_mode():
            now = self._clock()
            outputs += self._reap_waiting(now)
            outputs += self._reap_running(now)
            # Newcomers the batch has room for ride along in the decode's pass; those a
            # finishing row makes room for are prefilled after it, as before: held for
            # the next step's pass they would lose a step each, which cost more than the
            # second pass on a full batch (stories260K, 32 users).
            newcomers = self._admit() if self.packed and self._seqs else []
            if newcomers:
                outputs += self._decode_and_prefill(newcomers)
            elif self._seqs:
                outputs += self._decode()
            newcomers = self._admit()
            if newcomers:
                outputs += self._prefill(newcomers)
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._active.pop(out.request_id, None)
                    self._cancelled.discard(out.request_id)
        return outputs

    def close(self) -> None:
        """Nothing to let go of beyond memory: its weights are the pool's."""

    def timed_steps(self) -> None:
        """Every `step()` is one decode step: the runner times it."""
        return None

    def fail_all(self) -> list[StepOutput]:
        """Finish every request the engine holds with "error" and reset the batch.

        For the driver to call when :meth:`step` raised, a bug in the engine's own
        bookkeeping (a request's model or sampling errors end only that request, inside
        the step). Every request added and not yet finished gets its output, including
        ones a failed step had taken off the queue but not yet into the batch, and ones
        whose outputs the failed step produced but could not return.
        """
        with self._lock:
            active, self._active = self._active, {}
            self._waiting = deque()
            self._cancelled.clear()
        running = {s.req.request_id: s for s in self._seqs}
        self._seqs, self._kv = [], KVSlab(self.max_batch_size)
        self._hits.clear()
        if self.prefix is not None:  # what a broken step stored is not trusted
            self.prefix.clear()
        return [
            running[rid].output([], "", "error") if rid in running else StepOutput.ended(req, "error")
            for rid, req in active.items()
        ]

    def _expired(self, req: GenRequest, now: float) -> bool:
        return req.deadline is not None and now >= req.deadline

    def _reap_waiting(self, now: float) -> list[StepOutput]:
        """Finish queued requests that were cancelled or ran out of time, without compute."""
        outputs = []
        with self._lock:
            keep: deque[GenRequest] = deque()
            for req in self._waiting:
                reason: FinishReason | None = (
                    "cancelled"
                    if req.request_id in self._cancelled
                    else ("deadline" if self._expired(req, now) else None)
                )
                if reason is None:
                    keep.append(req)
                else:
                    outputs.append(StepOutput.ended(req, reason))
            self._waiting = keep
        return outputs

    def _reap_running(self, now: float) -> list[StepOutput]:
        with self._lock:
            cancelled = set(self._cancelled)
        outputs, keep = [], []
        for i, seq in enumerate(self._seqs):
            if seq.req.request_id in cancelled:
                outputs.append(seq.output([], "", "cancelled"))
            elif self._expired(seq.req, now):
                outputs.append(seq.output([], "", "deadline"))
            else:
                keep.append(i)
        if outputs:
            self._keep_rows(keep)
        return outputs

    def _admit(self) -> list[GenRequest]:
        if self.mode == "static" and self._seqs:
            return []
        room = self.max_batch_size - len(self._seqs)
        longest = max((len(s.req.prompt_ids) + s.max_tokens for s in self._seqs), default=0)
        taken: list[GenRequest] = []
        with self._lock:
            while self._waiting and len(taken) < room:
                req = self._waiting[0]
                longest_then = max(longest, min(len(req.prompt_ids) + req.params.max_tokens, self.loaded.context_len))
                if not self._kv_fits(len(self._seqs) + len(taken) + 1, longest_then):
                    break  # it waits for rows to finish (in order: a long one is not passed over)
                taken.append(self._waiting.popleft())
                longest = longest_then
        now = self._clock()
        for req in taken:
            req.admitted_at = now
            fresh = self.prefix is not None and not req.resume_ids and req.cache  # one taken over prefills cold
            if fresh and (hit := self.prefix.lookup(req.input_ids)) is not None:  # type: ignore[union-attr]
                self._hits[req.request_id] = hit
        return taken

    def _kv_fits(self, rows: int, longest: int) -> bool:
        """Whether ``rows`` rows of ``longest`` tokens fit the KV budget (one always does)."""
        return self._kv_budget is None or rows == 1 or rows * longest * self._token_bytes <= self._kv_budget

    def _new_seq(self, req: GenRequest) -> _Seq:
        room = self.loaded.context_len - len(req.prompt_ids)
        seq = _Seq(
            req=req,
            max_tokens=min(req.params.max_tokens, room),
            generator=make_generator(req.params),
            tracker=TextTracker(self.loaded.tokenizer, req.prompt_ids, req.params.stop),
            tokens=list(req.resume_ids),
            next_pos=len(req.input_ids),
            prefix=self._hits.pop(req.request_id, None),
        )
        # Where the first worker was: one draw per token taken, the text already emitted.
        for tok in req.resume_ids:
            draw_uniforms([req.params], [seq.generator])
            seq.tracker.add(tok)
        return seq

    def _already_done(self, seq: _Seq) -> FinishReason | None:
        """A resumed request whose delivered tokens already end it (the first worker died
        between its last chunk and its terminal event)."""
        if not seq.tokens:
            return None
        if self._ends(seq, seq.tokens[-1]):
            return "stop"
        return "length" if len(seq.tokens) >= seq.max_tokens else None

    def _advance(self, seqs: list[_Seq], logits: torch.Tensor) -> tuple[list[StepOutput], list[int]]:
        """Sample one token per sequence; return outputs and the indices still running."""
        outputs, alive = [], []
        tokens = self._select(seqs, logits)
        logprobs = self._logprobs(seqs, logits, tokens)
        for i, (seq, tok, lp) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
            out = self._append(seq, tok, lp)
            outputs.append(out)
            if not out.finished:
                alive.append(i)
        return outputs, alive

    def _select(self, seqs: list[_Seq], logits: torch.Tensor) -> list[int | None]:
        """One token per row, None for a row that cannot be sampled; draws are taken once."""
        params = [s.req.params for s in seqs]
        uniforms = draw_uniforms(params, [s.generator for s in seqs])
        generated = [s.tokens for s in seqs]
        try:
            return pick_tokens(logits, params, uniforms, generated)
        except Exception:
            log.exception("token selection failed for %d requests; selecting row by row", len(seqs))
        tokens: list[int | None] = []
        for i, (p, u) in enumerate(zip(params, uniforms, strict=True)):
            try:
                tokens += pick_tokens(logits[i : i + 1], [p], [u], generated[i : i + 1])
            except Exception:
                log.exception("request %s: token selection failed", seqs[i].req.request_id)
                tokens.append(None)
        return tokens

    @staticmethod
    def _logprobs(seqs: list[_Seq], logits: torch.Tensor, tokens: list[int | None]) -> list[TokenLogprob | None]:
        """The chosen tokens' log probabilities, for the rows that ask (a failure costs
        the row its token: it ends with "error", its neighbours unaffected)."""
        params = [s.req.params for s in seqs]
        try:
            return token_logprobs(logits, params, tokens)
        except Exception:
            log.exception("log probabilities failed for %d requests; ending those that asked", len(seqs))
        for i, p in enumerate(params):
            if p.logprobs is not None:
                tokens[i] = None
        return [None] * len(seqs)

    def _append(self, seq: _Seq, tok: int | None, logprob: TokenLogprob | None = None) -> StepOutput:
        if tok is None:
            log.error("request %s: no token could be selected; ending it with an error", seq.req.request_id)
            return seq.output([], "", "error")
        seq.tokens.append(tok)
        try:
            text = seq.tracker.add(tok)
        except Exception:
            log.exception("request %s: detokenizing failed; ending it with an error", seq.req.request_id)
            return seq.output([], "", "error")
        reason: FinishReason | None = None
        if self._ends(seq, tok):
            reason = "stop"
        elif len(seq.tokens) >= seq.max_tokens:
            reason = "length"
        # The end-of-sequence token is no part of the answer's text: no entry for it.
        return seq.output([tok], text, reason, [logprob] if logprob is not None and tok not in self._eos else [])

    def _ends(self, seq: _Seq, tok: int) -> bool:
        """The request stops at ``tok``: the end of sequence (unless it asked to go on past
        it) or a stop string its text now holds."""
        return (tok in self._eos and not seq.req.params.ignore_eos) or seq.tracker.stopped

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache) -> torch.Tensor:
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        out = self._model(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs)
        return out.logits[:, -1, :]

    def _lean_step(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache) -> torch.Tensor:
        """The batch's decode step by lean.py; where that raises, by transformers' forward
        (which rewrites the slab's new column whole), and, where that one passes, every
        later step too: the lean step was at fault, not a row."""
        try:
            return lean_decode.decode_step(self._model, ids, mask, pos, self._kv)
        except Exception:
            log.exception(
                "%s: the lean decode step failed; running it through transformers' forward", self.loaded.spec.name
            )
        logits = self._forward(ids, mask, pos, cache)
        self.lean = False
        log.error(
            "%s: transformers' forward ran the step the lean one failed: lean decoding is off", self.loaded.spec.name
        )
        return logits

    def _decode(self) -> list[StepOutput]:
        seqs = self._seqs
        dev = self._device
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=dev)
        pos = torch.tensor([[s.next_pos] for s in seqs], device=dev)
        kv = self._kv
        cache, mask = kv.step_inputs()

        def run(rows: list[int]) -> tuple[torch.Tensor, DynamicCache | None]:
            if len(rows) == len(seqs):  # the whole batch, in place: the usual path
                if self.lean:
                    return self._lean_step(ids, mask, pos, cache), None
                return self._forward(ids, mask, pos, cache), None
            # A part of the batch, on copies of its rows (a failed forward may have
            # written some layers' new column of the slab; the window is intact).
            idx = torch.tensor(rows, device=dev)
            part = DynamicCache(kv.snapshot(idx))
            return self._forward(ids[idx], mask[idx], pos[idx], part), part

        parts, failed = _isolating(list(range(len(seqs))), run, "decode step")
        outputs = [seqs[i].output([], "", "error") for i in failed]
        if len(parts) != 1 or failed:  # it ran in parts: the parts' caches become the batch
            rows = [i for part_rows, _ in parts for i in part_rows]
            self._seqs = [seqs[i] for i in rows]
            if not rows:
                kv.reset()
                return outputs
            part_mask = mask.index_select(0, torch.tensor(rows, device=mask.device))
            caches = [c for _, (_, c) in parts if c is not None]
            kv.reset([_cat_layer(n, caches) for n in range(len(kv.keys))], part_mask)
        else:
            kv.commit()
        for s in self._seqs:
            s.next_pos += 1
        logits = parts[0][1][0] if len(parts) == 1 else torch.cat([logits for _, (logits, _) in parts])
        more, alive = self._advance(self._seqs, logits)
        if len(alive) < len(self._seqs):
            self._remember(self._seqs, more)
            self._keep_rows(alive)
        return outputs + more

    def _newcomers(self, reqs: list[GenRequest]) -> tuple[list[_Seq], list[StepOutput]]:
        """Sequences for admitted requests, less those a resume already ended (their outputs)."""
        seqs = [self._new_seq(r) for r in reqs]
        done = [seq.output([], "", reason) for seq in seqs if (reason := self._already_done(seq))]
        if done:
            ended = {out.request_id for out in done}
            seqs = [seq for seq in seqs if seq.req.request_id not in ended]
        return seqs, done

    def _decode_and_prefill(self, reqs: list[GenRequest]) -> list[StepOutput]:
        """The running rows' decode step and the newcomers' prefill in one packed pass
        (packed.py); apart, as two passes that isolate a failing row, if it fails."""
        seqs, outputs = self._newcomers(reqs)
        if not seqs:
            return outputs + self._decode()
        try:
            logits, layout = self._packed_forward(seqs)
        except Exception:
            log.exception("packed step failed (%d + %d rows); decoding and prefilling apart", self.running, len(seqs))
            hits = [seq for seq in seqs if seq.prefix is not None]
            cold = [seq for seq in seqs if seq.prefix is None]
            return outputs + self._decode() + self._prefill([seq.req for seq in cold]) + self._prefill_hits(hits)
        for seq in seqs:
            seq.prefix = None  # a hit's entry's tensors are not this request's to hold
        running = self._seqs
        n = len(running)
        self._kv.commit()
        for s in running:
            s.next_pos += 1
        more, alive = self._advance(running, logits[:n])
        outputs += more
        if len(alive) < n:
            self._remember(running, more)
            self._keep_rows(alive)
        more, alive = self._advance(seqs, logits[n:])
        outputs += more
        if alive:
            self._join(seqs, layout, alive)
        return outputs

    def _packed_forward(self, seqs: list[_Seq]) -> tuple[torch.Tensor, packed.Layout]:
        running, dev = self._seqs, self._device
        _, mask = self._kv.step_inputs()
        tokens = [s.tokens[-1] for s in running]
        pos = [s.next_pos for s in running]
        lengths: list[int] = []
        prefixes: list[list[KV] | None] = []
        for seq in seqs:
            ids, hit = seq.req.input_ids, seq.prefix
            # A prefix cache hit rides along too: its tokens after the cached ones, which
            # attend over the cached keys and values (packed.arena_attention).
            cached = hit.tokens if hit is not None else 0
            tokens += ids[cached:]
            pos += range(cached, len(ids))
            lengths.append(len(ids) - cached)
            prefixes.append([(k[:, :, :cached], v[:, :, :cached]) for k, v in hit.value] if hit is not None else None)
        ends = torch.tensor(lengths, device=dev).cumsum(0) + len(running) - 1
        keep = torch.cat([torch.arange(len(running), device=dev), ends])
        layout = packed.Layout(self._kv, mask.bool()[:, None, None, :], lengths, prefixes)
        out = self._model(
            input_ids=torch.tensor([tokens], device=dev),
            position_ids=torch.tensor([pos], device=dev),
            use_cache=False,
            logits_to_keep=keep,
            arena_layout=layout,
        )
        return out.logits[0], layout

    def _join(self, seqs: list[_Seq], layout: packed.Layout, alive: list[int]) -> None:
        """Newcomers of a packed step (``alive`` of ``seqs``) join the running batch with
        their prompts' keys and values, left-padded to the longest, as a prefill's are."""
        whole = [layout.cached(i) + length for i, length in enumerate(layout.lengths)]
        mask = _left_padded(whole).to(self._device)
        width = mask.shape[1]
        layers = []
        for kept in layout.prompts:
            k0, v0 = kept[0]
            keys = k0.new_zeros((len(seqs), k0.shape[1], width, k0.shape[3]))
            values = v0.new_zeros((len(seqs), v0.shape[1], width, v0.shape[3]))
            for row, ((k, v), length) in enumerate(zip(kept, whole, strict=True)):
                keys[row, :, width - length :] = k[0]
                values[row, :, width - length :] = v[0]
            layers.append((keys, values))
        self._merge([seqs[i] for i in alive], layers, mask, alive)

    def _prefill(self, reqs: list[GenRequest]) -> list[StepOutput]:
        seqs, done_outputs = self._newcomers(reqs)
        hits = [seq for seq in seqs if seq.prefix is not None]
        seqs = [seq for seq in seqs if seq.prefix is None]
        done_outputs += self._prefill_hits(hits)
        reqs = [seq.req for seq in seqs]
        if not seqs:
            return done_outputs
        parts, failed = _isolating(
            list(range(len(seqs))), lambda rows: self._prefill_rows([reqs[i] for i in rows]), "prefill"
        )
        outputs = done_outputs + [seqs[i].output([], "", "error") for i in failed]
        for rows, (logits, cache, mask) in parts:
            part = [seqs[i] for i in rows]
            more, alive = self._advance(part, logits)
            outputs += more
            if alive:
                layers = [(layer.keys, layer.values) for layer in _layers(cache)]
                self._merge([part[i] for i in alive], layers, mask, alive)
        return outputs

    def _prefill_rows(self, reqs: list[GenRequest]) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """One padded forward pass over ``reqs``' prompts (and resumed tokens): last
        logits, new cache, mask."""
        mask = _left_padded([len(r.input_ids) for r in reqs])
        ids = torch.full(mask.shape, self._pad_id, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, mask.shape[1] - len(r.input_ids) :] = torch.tensor(r.input_ids)
        ids, mask = ids.to(self._device), mask.to(self._device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        return self._forward(ids, mask, pos, cache), cache, mask

    # ---- the prefix cache -------------------------------------------------------------

    def _prefill_hits(self, seqs: list[_Seq]) -> list[StepOutput]:
        """Each request with a prefix hit: its prompt's new tokens in a pass over its
        cached keys and values (batch 1; a failure ends only that request)."""
        outputs = []
        for seq in seqs:
            try:
                logits, layers, mask = self._extend(seq)
            except Exception:
                log.exception("prefill over a cached prefix failed; ending the request with an error")
                outputs.append(seq.output([], "", "error"))
                continue
            more, alive = self._advance([seq], logits)
            outputs += more
            if alive:
                self._merge([seq], layers, mask, alive)
        return outputs

    def _extend(self, seq: _Seq) -> tuple[torch.Tensor, list[KV], torch.Tensor]:
        """Last logits, keys and values, and mask of ``seq``'s input after its cached prefix."""
        assert seq.prefix is not None
        ids, reused, dev = seq.req.input_ids, seq.prefix.tokens, self._device
        cache = DynamicCache([(k[:, :, :reused], v[:, :, :reused]) for k, v in seq.prefix.value])
        mask = torch.ones((1, len(ids)), dtype=torch.long, device=dev)
        pos = torch.arange(reused, len(ids), device=dev)[None]
        logits = self._forward(torch.tensor([ids[reused:]], device=dev), mask, pos, cache)
        seq.prefix = None  # the entry's tensors are not this request's to hold
        return logits, [(layer.keys, layer.values) for layer in _layers(cache)], mask

    def _remember(self, seqs: list[_Seq], outputs: list[StepOutput]) -> None:
        """Store the keys and values of the running rows that just ended (``outputs`` are
        the rows', in order) in the prefix cache: the tokens fed, every one but the last."""
        if self.prefix is None:
            return
        for row, (seq, out) in enumerate(zip(seqs, outputs, strict=True)):
            if out.finish_reason in ("stop", "length") and seq.req.cache:
                ids = seq.req.prompt_ids + seq.tokens[:-1]  # tokens holds the resumed ones too
                layers = self._kv.row(row, len(ids))
                if layers is not None:
                    self.prefix.store(ids, layers, sum(k.nbytes + v.nbytes for k, v in layers))

    # ---- the running batch's rows ------------------------------------------------------

    def _merge(self, seqs: list[_Seq], layers: list[KV], mask: torch.Tensor, rows: list[int]) -> None:
        """Newcomers (rows ``rows`` of their prefill's keys and values) join the running batch."""
        if len(rows) < mask.shape[0]:
            idx = torch.tensor(rows, device=mask.device)
            layers = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in layers]
            mask = mask.index_select(0, idx)
        self._kv.add(layers, mask)
        self._seqs = self._seqs + seqs

    def _keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self._seqs = []
            self._kv.reset()
            return
        self._seqs = [self._seqs[i] for i in self._kv.keep(rows)]


def _left_padded(lengths: list[int]) -> torch.Tensor:
    """The mask of rows of these lengths, right-aligned to the longest: ``[rows, longest]``."""
    width = max(lengths)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return mask


def _isolating(
    rows: list[int], run: Callable[[list[int]], R], what: str
) -> tuple[list[tuple[list[int], R]], list[int]]:
    """``run(rows)``; if it raises, the same for each half in turn, down to single rows.

    Returns the parts that ran, in row order, with their results, and the rows that
    failed on their own. Nothing extra when nothing fails; one poison row among n costs
    about 2·log2(n) more (smaller) runs. A failure that is no row's fault (the device)
    ends every row, after 2n - 1 runs.
    """
    try:
        return [(rows, run(rows))], []
    except Exception:
        if len(rows) == 1:
            log.exception("%s failed for a request on its own; ending it with an error", what)
            return [], rows
        log.exception("%s of %d requests failed; running them in halves to isolate the cause", what, len(rows))
    mid = len(rows) // 2
    left, right = _isolating(rows[:mid], run, what), _isolating(rows[mid:], run, what)
    return left[0] + right[0], left[1] + right[1]


def _cat_layer(n: int, caches: list[DynamicCache]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``n``'s keys and values of ``caches`` stacked along the batch."""
    return torch.cat([_layers(c)[n].keys for c in caches]), torch.cat([_layers(c)[n].values for c in caches])


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers; every layer here has `keys` and `values` (None until first used)."""
    return list(cache.layers)
