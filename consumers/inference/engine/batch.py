"""A stepping batch engine: many generation requests share one padded forward pass.

The engine is synchronous and single-threaded by design: the consumer drives
:meth:`BatchEngine.step` from one dedicated thread and feeds it with the thread-safe
:meth:`BatchEngine.add` / :meth:`BatchEngine.cancel`; the event loop never runs torch.

The engine is the queue (:class:`~consumers.inference.engine.scheduler.Scheduler`:
what waits, what is cancelled, who joins the batch at a step), the running batch
(:class:`~consumers.inference.engine.running.RunningBatch`: the rows and the forward passes
that step them, with poison isolation) and the sampler
(:class:`~consumers.inference.engine.sequences.Sampler`: each row's next token, text and
end), stepped together by :meth:`BatchEngine.step`.

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

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import torch

from consumers.inference.config import EngineConfig
from consumers.inference.engine import lean as lean_decode
from consumers.inference.engine import packed, prepack
from consumers.inference.engine.kvcache import bytes_per_token
from consumers.inference.engine.prefix import PrefixCache
from consumers.inference.engine.running import RunningBatch
from consumers.inference.engine.scheduler import Scheduler
from consumers.inference.engine.sequences import Sampler
from consumers.inference.engine_io import EngineStats, GenRequest, StepOutput
from consumers.inference.errors import ContextExceeded, KVBudgetExceeded, PermanentError, PromptTooLong
from consumers.inference.model_loading import LoadedModel

log = logging.getLogger(__name__)
R = TypeVar("R")


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
        self.sampler = Sampler(loaded)  # each row's next token, text and end (sequences.py)
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        #: The rows, their KV slab and the forward passes that step them (running.py).
        self.batch = RunningBatch(loaded, self.sampler, self.prefix, max_batch_size)
        #: A step that decodes and admits newcomers runs as one packed pass (packed.py);
        #: ``pack=None``: where that pays (packed.worth_packing).
        wanted = packed.worth_packing(self._model) if pack is None else pack
        self.packed = mode == "continuous" and self.batch.keeps_last and wanted and packed.enable(self._model)
        #: The whole batch's decode steps skip transformers' forward (lean.py), for a
        #: packing engine's Llama; ``lean=False``: always through it.
        self.batch.lean = self.packed and lean is not False and lean_decode.supported(self._model)
        token_bytes = bytes_per_token(self._model) if kv_budget_bytes is not None else 0
        #: The queue: what is added, waiting, cancelled, and who joins the batch (scheduler.py).
        self.scheduler = Scheduler(mode, max_batch_size, loaded.context_len, kv_budget_bytes, token_bytes, clock)

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
    def lean(self) -> bool:
        """Whether the whole batch's decode steps skip transformers' forward (lean.py)."""
        return self.batch.lean

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
        self.scheduler.add(req)

    def cancel(self, request_id: str) -> None:
        """Finish ``request_id`` with "cancelled" at the next step (unknown ids are ignored)."""
        self.scheduler.cancel(request_id)

    # ---- stepping (one thread) -----------------------------------------------------

    @property
    def running(self) -> int:
        return len(self.batch.seqs)

    def budgets(self) -> tuple[list[int], list[int]]:
        """Token budgets left: of each running request, and of each waiting one in order
        (upper bounds: a request may stop early). Read from any thread; approximate."""
        waiting = self.scheduler.waiting_budgets()
        running = [seq.max_tokens - len(seq.tokens) for seq in list(self.batch.seqs)]
        return running, waiting

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> EngineStats:
        running, waiting = self.budgets()
        prefix = self.prefix.stats if self.prefix is not None else None
        return EngineStats(tuple(running), tuple(waiting), prefix, self.packing_done)

    def has_work(self) -> bool:
        return bool(self.batch.seqs) or bool(self.scheduler.waiting)

    def step(self) -> list[StepOutput]:
        """Run one decode step for running requests and one prefill of admitted ones."""
        outputs: list[StepOutput] = []
        with self._step_lock, torch.inference_mode():
            now = self._clock()
            outputs += self.scheduler.reap_waiting(now)
            outputs += self._reap_running(now)
            # Newcomers the batch has room for ride along in the decode's pass; those a
            # finishing row makes room for are prefilled after it, as before: held for
            # the next step's pass they would lose a step each, which cost more than the
            # second pass on a full batch (stories260K, 32 users).
            newcomers = self._admit() if self.packed and self.batch.seqs else []
            if newcomers:
                outputs += self.batch.decode_and_prefill(newcomers)
            elif self.batch.seqs:
                outputs += self.batch.decode()
            newcomers = self._admit()
            if newcomers:
                outputs += self.batch.prefill(newcomers)
        self.scheduler.finished(outputs)
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
        active = self.scheduler.clear()
        running = self.batch.reset()
        return [
            running[rid].output([], "", "error") if rid in running else StepOutput.ended(req, "error")
            for rid, req in active.items()
        ]

    def _reap_running(self, now: float) -> list[StepOutput]:
        cancelled = self.scheduler.cancels()
        outputs, keep = [], []
        for i, seq in enumerate(self.batch.seqs):
            if seq.req.request_id in cancelled:
                outputs.append(seq.output([], "", "cancelled"))
            elif Scheduler.expired(seq.req, now):
                outputs.append(seq.output([], "", "deadline"))
            else:
                keep.append(i)
        if outputs:
            self.batch.keep_rows(keep)
        return outputs

    def _admit(self) -> list[GenRequest]:
        """The waiting requests that join the batch now (the scheduler's call), each looked
        up in the prefix cache."""
        taken = self.scheduler.admit(self.batch.seqs)
        self.batch.look_up(taken)
        return taken
