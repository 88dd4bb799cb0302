"""Putting a request's live output back in order (pure logic, no broker).

Delivery may fan chunks out concurrently, and a retry may attach mid-stream, so the
gateway receives chunks out of order, twice, or after the terminal event. The assembler
emits each chunk once, in sequence order, and says when the answer is complete.
"""

from __future__ import annotations

from typing import Any

from events.models import TERMINAL_TYPES


class Assembler:
    def __init__(self) -> None:
        self.next_seq = 0
        self.pending: dict[int, Any] = {}
        self.terminal = None
        self.text = ""
        #: The emitted chunks' log probabilities, in order (those that carry any).
        self.logprobs: list = []

    def add(self, event) -> list:
        """Take one event; return the chunk events that are now deliverable, in order."""
        if event.type in TERMINAL_TYPES:
            self.terminal = self.terminal or event
            return []
        if event.type != "tokens.generated" or event.seq < self.next_seq:
            return []
        self.pending[event.seq] = event
        ready = []
        while self.next_seq in self.pending:
            chunk = self.pending.pop(self.next_seq)
            self.text += chunk.text
            self.logprobs += chunk.logprobs or ()
            ready.append(chunk)
            self.next_seq += 1
        return ready

    @property
    def done(self) -> bool:
        """The terminal event arrived and every chunk before it was emitted."""
        return self.terminal is not None and self.next_seq >= getattr(self.terminal, "chunks", 0)

    def remainder(self) -> str:
        """Text of the completed answer not yet emitted (chunks that never arrived live)."""
        full = getattr(self.terminal, "text", None)
        if full is None or not full.startswith(self.text):
            return ""
        return full[len(self.text) :]
