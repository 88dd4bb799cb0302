"""Putting a request's live output back in order (pure logic, no broker).

Delivery may fan chunks out concurrently, and a retry may attach mid-stream, so the
gateway receives chunks out of order, twice, or after the terminal event. The assembler
emits each chunk once, in sequence order, and says when the answer is complete.
"""

from __future__ import annotations

from events.models import ChatCompleted, ChatFailed, EventBase, PromptRejected, Terminal, TokenLogprob, TokensGenerated


class Assembler:
    def __init__(self) -> None:
        self.next_seq = 0
        self.pending: dict[int, TokensGenerated] = {}
        self.terminal: Terminal | None = None
        self.text = ""
        #: The emitted chunks' log probabilities, in order (those that carry any).
        self.logprobs: list[TokenLogprob] = []

    def add(self, event: EventBase) -> list[TokensGenerated]:
        """Take one event; return the chunk events that are now deliverable, in order."""
        if isinstance(event, Terminal):
            self.terminal = self.terminal or event
            return []
        if not isinstance(event, TokensGenerated) or event.seq < self.next_seq:
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
        match self.terminal:
            case ChatCompleted(chunks=chunks) | ChatFailed(chunks=chunks):
                return self.next_seq >= chunks
            case PromptRejected():
                return True
        return False

    def remainder(self) -> str:
        """Text of the completed answer not yet emitted (chunks that never arrived live)."""
        if not isinstance(self.terminal, ChatCompleted) or not self.terminal.text.startswith(self.text):
            return ""
        return self.terminal.text[len(self.text) :]
