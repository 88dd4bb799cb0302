"""The batch engine's queue: the requests added and not yet finished, those waiting in
order, the cancels, and which waiting requests join the running batch at a step (room in
the batch, the KV budget, the mode), as vLLM's scheduler decides apart from what runs
the model. Its producer side (`add`, `cancel`) is thread-safe; the rest runs on the
engine's stepping thread."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

from consumers.inference.engine.sequences import Seq
from consumers.inference.engine_io import FinishReason, GenRequest, StepOutput
from consumers.inference.errors import PermanentError


class Scheduler:
    """``mode="continuous"``: waiting requests join the running batch at every step;
    ``"static"``: only once it is empty. ``kv_budget_bytes`` (None: none) at
    ``token_bytes`` a token and row: a request joins only while every row at its longest
    fits (the slab is left-padded to its longest row); a lone request always runs."""

    def __init__(
        self,
        mode: Literal["static", "continuous"],
        max_batch_size: int,
        context_len: int,
        kv_budget_bytes: int | None,
        token_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self.mode = mode
        self.max_batch_size = max_batch_size
        self.context_len = context_len
        self.kv_budget_bytes = kv_budget_bytes
        self.token_bytes = token_bytes
        self.clock = clock
        self.lock = threading.Lock()
        self.waiting: deque[GenRequest] = deque()
        self.cancelled: set[str] = set()
        self.active: dict[str, GenRequest] = {}  # added and not yet finished, wherever they are

    def add(self, req: GenRequest) -> None:
        with self.lock:
            if req.request_id in self.active:
                raise PermanentError(f"request {req.request_id} is already in the engine")
            self.active[req.request_id] = req
            self.waiting.append(req)

    def cancel(self, request_id: str) -> None:
        """Finish ``request_id`` with "cancelled" at the next step (unknown ids are ignored)."""
        with self.lock:
            if request_id in self.active:
                self.cancelled.add(request_id)

    def waiting_budgets(self) -> list[int]:
        """The token budgets of the waiting requests, in order (read from any thread)."""
        with self.lock:
            return [req.params.max_tokens - len(req.resume_ids) for req in self.waiting]

    def cancels(self) -> set[str]:
        with self.lock:
            return set(self.cancelled)

    @staticmethod
    def expired(req: GenRequest, now: float) -> bool:
        return req.deadline is not None and now >= req.deadline

    def reap_waiting(self, now: float) -> list[StepOutput]:
        """Finish queued requests that were cancelled or ran out of time, without compute."""
        outputs = []
        with self.lock:
            keep: deque[GenRequest] = deque()
            for req in self.waiting:
                reason: FinishReason | None = (
                    "cancelled"
                    if req.request_id in self.cancelled
                    else ("deadline" if self.expired(req, now) else None)
                )
                if reason is None:
                    keep.append(req)
                else:
                    outputs.append(StepOutput.ended(req, reason))
            self.waiting = keep
        return outputs

    def admit(self, running: Sequence[Seq]) -> list[GenRequest]:
        """The waiting requests that join ``running`` now, in order (a long one that does
        not fit the KV budget yet is not passed over), marked admitted."""
        if self.mode == "static" and running:
            return []
        room = self.max_batch_size - len(running)
        longest = max((len(s.req.prompt_ids) + s.max_tokens for s in running), default=0)
        taken: list[GenRequest] = []
        with self.lock:
            while self.waiting and len(taken) < room:
                req = self.waiting[0]
                longest_then = max(longest, min(len(req.prompt_ids) + req.params.max_tokens, self.context_len))
                if not self.kv_fits(len(running) + len(taken) + 1, longest_then):
                    break  # it waits for rows to finish
                taken.append(self.waiting.popleft())
                longest = longest_then
        now = self.clock()
        for req in taken:
            req.admitted_at = now
        return taken

    def kv_fits(self, rows: int, longest: int) -> bool:
        """Whether ``rows`` rows of ``longest`` tokens fit the KV budget (one always does)."""
        return self.kv_budget_bytes is None or rows == 1 or rows * longest * self.token_bytes <= self.kv_budget_bytes

    def finished(self, outputs: list[StepOutput]) -> None:
        """The requests a step finished leave the engine."""
        with self.lock:
            for out in outputs:
                if out.finished:
                    self.active.pop(out.request_id, None)
                    self.cancelled.discard(out.request_id)

    def clear(self) -> dict[str, GenRequest]:
        """Forget every request (a failed step's reset): those that were active."""
        with self.lock:
            active, self.active = self.active, {}
            self.waiting = deque()
            self.cancelled.clear()
        return active


class BatchHold:
    """The static mode's hold, applied by the runner that steps an engine: how long a
    micro-batch waits to fill before it starts (``max_wait_s``; 0: none, as in continuous
    mode), counted from when its first request began to wait."""

    def __init__(self, max_wait_s: float, max_batch_size: int) -> None:
        self.max_wait_s = max_wait_s
        self.max_batch_size = max_batch_size
        self._first: float | None = None

    def seconds(self, running: int, waiting: int) -> float:
        """Seconds to wait for a fuller micro-batch before starting one (0: start now)."""
        if not self.max_wait_s or running or not waiting or waiting >= self.max_batch_size:
            self._first = None
            return 0.0
        now = time.monotonic()
        self._first = self._first or now
        return max(0.0, self.max_wait_s - (now - self._first))

    def reset(self) -> None:
        self._first = None
