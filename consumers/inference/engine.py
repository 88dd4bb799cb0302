"""A stepping batch engine: many generation requests share one padded forward pass.

The engine is synchronous and single-threaded by design: the consumer drives
:meth:`BatchEngine.step` from one dedicated thread and feeds it with the thread-safe
:meth:`BatchEngine.add` / :meth:`BatchEngine.cancel`; the event loop never runs torch.

Batch layout. Running sequences are left-padded to a common length ``T``: the KV cache
holds ``[batch, heads, T, head_dim]`` per layer, ``mask`` ``[batch, T]`` marks real
tokens, and each sequence keeps its own absolute position, passed as ``position_ids``
(so padding never shifts RoPE). Newcomers are prefilled as their own padded batch and
merged by left-padding both caches to the longer length and concatenating rows;
finished rows are dropped with ``index_select`` and leading all-padding columns trimmed.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from consumers.inference.errors import PermanentError, PromptTooLong
from consumers.inference.models import LoadedModel
from consumers.inference.sampling import SamplingParams, TextTracker, make_generator, select_tokens

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "deadline", "cancelled", "error"]


@dataclass
class GenRequest:
    """One completion to generate from already-tokenized prompt ids."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None = None  # wall-clock epoch seconds (time.time()); None: no deadline


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]  # includes an EOS token when the model emitted one
    new_text: str  # incremental text; never splits a character or shows a partial stop string
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int  # total so far


@dataclass
class _Seq:
    req: GenRequest
    max_tokens: int
    generator: torch.Generator | None
    tracker: TextTracker
    tokens: list[int]
    next_pos: int  # position id of the next token fed to the model

    def output(self, new: list[int], text: str, reason: FinishReason | None) -> StepOutput:
        if reason is not None:
            text += self.tracker.flush()
        return StepOutput(
            request_id=self.req.request_id,
            new_token_ids=new,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(self.req.prompt_ids),
            completion_tokens=len(self.tokens),
        )


class BatchEngine:
    """Generates for many requests of one model, one token per request per step.

    ``mode="continuous"``: waiting requests join the running batch at every step and
    finished ones leave it. ``mode="static"``: waiting requests are admitted only when
    the running batch is empty, so each micro-batch runs to completion together.

    A prompt that leaves no room in the context raises :class:`PromptTooLong` at
    :meth:`add`; otherwise ``max_tokens`` is clamped to the room left in the context
    (the request then finishes with ``"length"``).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        mode: Literal["static", "continuous"],
        max_batch_size: int = 32,
        clock: Callable[[], float] = time.time,
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
        self._eos = set(loaded.eos_ids)
        pad = loaded.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else (loaded.eos_ids[0] if loaded.eos_ids else 0)
        params = inspect.signature(self._model.forward).parameters
        # transformers 5.x renames past_key_values to cache (the old name is deprecated).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_last = "logits_to_keep" in params
        self._lock = threading.Lock()
        self._waiting: deque[GenRequest] = deque()
        self._cancelled: set[str] = set()
        self._active_ids: set[str] = set()
        self._seqs: list[_Seq] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [batch, T] of 0/1

    # ---- thread-safe producer side -------------------------------------------------

    def add(self, req: GenRequest) -> None:
        """Queue ``req``; raises ``PromptTooLong`` / ``PermanentError`` if it can never run."""
        n = len(req.prompt_ids)
        if n == 0:
            raise PermanentError(f"request {req.request_id}: the prompt is empty")
        if n >= self.loaded.context_len:
            raise PromptTooLong(n, self.loaded.context_len)
        with self._lock:
            if req.request_id in self._active_ids:
                raise PermanentError(f"request {req.request_id} is already in the engine")
            self._active_ids.add(req.request_id)
            self._waiting.append(req)

    def cancel(self, request_id: str) -> None:
        """Finish ``request_id`` with "cancelled" at the next step (unknown ids are ignored)."""
        with self._lock:
            if request_id in self._active_ids:
                self._cancelled.add(request_id)

    # ---- stepping (one thread) -----------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._seqs)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._seqs) or bool(self._waiting)

    def step(self) -> list[StepOutput]:
        """Run one decode step for running requests and one prefill of admitted ones."""
        outputs: list[StepOutput] = []
        with torch.inference_mode():
            now = self._clock()
            outputs += self._reap_waiting(now)
            outputs += self._reap_running(now)
            if self._seqs:
                outputs += self._decode()
            newcomers = self._admit()
            if newcomers:
                outputs += self._prefill(newcomers)
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._active_ids.discard(out.request_id)
                    self._cancelled.discard(out.request_id)
        return outputs

    def fail_all(self) -> list[StepOutput]:
        """Finish every running and waiting request with "error" and reset the batch.

        For the driver to call when :meth:`step` raised (model errors inside a step are
        already turned into "error" outputs by the step itself).
        """
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
            self._active_ids.clear()
            self._cancelled.clear()
        outputs = [s.output([], "", "error") for s in self._seqs]
        outputs += [StepOutput(r.request_id, [], "", True, "error", len(r.prompt_ids), 0) for r in waiting]
        self._seqs, self._cache, self._mask = [], None, None
        return outputs

    def _expired(self, req: GenRequest, now: float) -> bool:
        return req.deadline is not None and now >= req.deadline

    def _reap_waiting(self, now: float) -> list[StepOutput]:
        """Finish queued requests that were cancelled or ran out of time, without compute."""
        outputs = []
        with self._lock:
            keep: deque[GenRequest] = deque()
            for req in self._waiting:
                reason = (
                    "cancelled"
                    if req.request_id in self._cancelled
                    else ("deadline" if self._expired(req, now) else None)
                )
                if reason is None:
                    keep.append(req)
                else:
                    outputs.append(StepOutput(req.request_id, [], "", True, reason, len(req.prompt_ids), 0))
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
        with self._lock:
            taken = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        return taken

    def _new_seq(self, req: GenRequest) -> _Seq:
        room = self.loaded.context_len - len(req.prompt_ids)
        return _Seq(
            req=req,
            max_tokens=min(req.params.max_tokens, room),
            generator=make_generator(req.params),
            tracker=TextTracker(self.loaded.tokenizer, req.prompt_ids, req.params.stop),
            tokens=[],
            next_pos=len(req.prompt_ids),
        )

    def _advance(self, seqs: list[_Seq], logits: torch.Tensor) -> tuple[list[StepOutput], list[int]]:
        """Sample one token per sequence; return outputs and the indices still running."""
        tokens = select_tokens(logits, [s.req.params for s in seqs], [s.generator for s in seqs])
        outputs, alive = [], []
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            seq.tokens.append(tok)
            text = seq.tracker.add(tok)
            reason: FinishReason | None = None
            if tok in self._eos or seq.tracker.stopped:
                reason = "stop"
            elif len(seq.tokens) >= seq.max_tokens:
                reason = "length"
            else:
                alive.append(i)
            outputs.append(seq.output([tok], text, reason))
        return outputs, alive

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        out = self._model(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs)
        return out.logits[:, -1, :]

    def _decode(self) -> list[StepOutput]:
        seqs = self._seqs
        dev = self._device
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=dev)
        pos = torch.tensor([[s.next_pos] for s in seqs], device=dev)
        mask = torch.cat([self._mask, self._mask.new_ones(len(seqs), 1)], dim=1)
        try:
            logits = self._forward(ids, mask, pos, self._cache)
        except Exception:
            log.exception("decode step failed; failing %d running requests", len(seqs))
            self._seqs, self._cache, self._mask = [], None, None
            return [s.output([], "", "error") for s in seqs]
        self._mask = mask
        for s in seqs:
            s.next_pos += 1
        outputs, alive = self._advance(seqs, logits)
        if len(alive) < len(seqs):
            self._keep_rows(alive)
        return outputs

    def _prefill(self, reqs: list[GenRequest]) -> list[StepOutput]:
        seqs = [self._new_seq(r) for r in reqs]
        width = max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        try:
            logits = self._forward(ids, mask, pos, cache)
        except Exception:
            log.exception("prefill of %d requests failed", len(reqs))
            return [s.output([], "", "error") for s in seqs]
        outputs, alive = self._advance(seqs, logits)
        if alive:
            self._merge([seqs[i] for i in alive], cache, mask, alive)
        return outputs

    # ---- KV cache surgery ----------------------------------------------------------

    def _merge(self, seqs: list[_Seq], cache: DynamicCache, mask: torch.Tensor, rows: list[int]) -> None:
        if len(rows) < mask.shape[0]:
            idx = torch.tensor(rows, device=mask.device)
            _select_rows(cache, idx)
            mask = mask.index_select(0, idx)
        if self._cache is None:
            self._seqs, self._cache, self._mask = seqs, cache, mask
            self._trim()
            return
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(self._cache.layers, cache.layers):
            if old.keys is None or new.keys is None:
                continue
            old.keys = torch.cat([_left_pad(old.keys, width, -2), _left_pad(new.keys, width, -2)])
            old.values = torch.cat([_left_pad(old.values, width, -2), _left_pad(new.values, width, -2)])
        self._mask = torch.cat([_left_pad(self._mask, width, -1), _left_pad(mask, width, -1)])
        self._seqs = self._seqs + seqs

    def _keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self._seqs, self._cache, self._mask = [], None, None
            return
        idx = torch.tensor(rows, device=self._mask.device)
        _select_rows(self._cache, idx)
        self._mask = self._mask.index_select(0, idx)
        self._seqs = [self._seqs[i] for i in rows]
        self._trim()

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row."""
        first = int(self._mask.any(dim=0).long().argmax())
        if first == 0:
            return
        self._mask = self._mask[:, first:]
        for layer in self._cache.layers:
            if layer.keys is not None:
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]


def _select_rows(cache: DynamicCache, idx: torch.Tensor) -> None:
    for layer in cache.layers:
        if layer.keys is not None:
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    pad = [0, 0] * (-dim - 1) + [missing, 0]
    return F.pad(t, pad)
