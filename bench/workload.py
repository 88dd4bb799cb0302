"""What a benchmark sends: the workload description and the requests drawn from it.

A workload is deterministic for a seed, so every target of one comparison (and the
in-process ceiling) sees the same prompts and the same `max_tokens`, in the same order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

PROMPTS = (
    "Tell me a short story about a dragon who learns to read.",
    "Explain what a message queue is to a new engineer.",
    "Write a haiku about the sea at night.",
    "List three reasons to write tests before shipping code.",
    "Summarize the plot of a mystery novel in two sentences.",
    "What is the difference between latency and throughput?",
    "Describe a sunrise over the mountains.",
    "Give me a recipe for a simple tomato soup.",
)
FOLLOW_UPS = (
    "Make it shorter.",
    "Now say it again, but for a child.",
    "Can you add one more detail?",
)


@dataclass(frozen=True)
class LengthMix:
    """Output lengths as (max_tokens, weight) pairs: "16" or "16:0.8,128:0.2"."""

    choices: tuple[tuple[int, float], ...]

    @classmethod
    def parse(cls, text: str) -> LengthMix:
        pairs = []
        for part in text.split(","):
            tokens, _, weight = part.partition(":")
            pairs.append((int(tokens), float(weight or 1.0)))
        if not pairs or any(t <= 0 or w <= 0 for t, w in pairs):
            raise ValueError(f"length mix {text!r}: use positive 'tokens[:weight],...'")
        return cls(tuple(pairs))

    def draw(self, rng: random.Random) -> int:
        tokens, weights = zip(*self.choices, strict=True)
        return rng.choices(tokens, weights=weights)[0]

    @property
    def mean(self) -> float:
        total = sum(w for _, w in self.choices)
        return sum(t * w for t, w in self.choices) / total

    def __str__(self) -> str:
        return ",".join(f"{t}:{w:g}" for t, w in self.choices)


@dataclass(frozen=True)
class Workload:
    """One load level against one target.

    Closed loop: `concurrency` users, each sending its next session as soon as the last
    one ends. Open loop: sessions arrive as a Poisson process at `rate` per second,
    whatever the server's state. A session is `turns` requests in a row, each turn
    carrying the conversation so far (the replies the server gave).
    """

    model: str
    mode: Literal["closed", "open"] = "closed"
    concurrency: int = 1
    rate: float = 1.0
    duration_s: float = 20.0
    max_requests: int = 200
    lengths: LengthMix = field(default_factory=lambda: LengthMix(((16, 1.0),)))
    turns: int = 1
    seed: int = 0
    timeout_s: float = 120.0
    ignore_eos: bool = True  # send "ignore_eos"; off for servers that reject unknown fields
    body_extra: tuple[tuple[str, object], ...] = ()  # more fields for every request's body

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode {self.mode!r}: use 'closed' or 'open'")
        if self.concurrency < 1 or self.rate <= 0 or self.turns < 1 or self.max_requests < 1:
            raise ValueError("concurrency, turns and max_requests must be >= 1, rate > 0")

    @property
    def offered_load(self) -> float:
        """Concurrent users (closed loop) or sessions per second (open loop)."""
        return float(self.concurrency) if self.mode == "closed" else self.rate

    @property
    def load_label(self) -> str:
        return f"{self.concurrency} users" if self.mode == "closed" else f"{self.rate:g} req/s"


@dataclass(frozen=True)
class Turn:
    """One request of a session: the new user message and its output budget."""

    user_message: str
    max_tokens: int


def draw_session(workload: Workload, rng: random.Random) -> list[Turn]:
    """The turns of one session, drawn from `rng` (the caller owns its seeding)."""
    first = Turn(rng.choice(PROMPTS), workload.lengths.draw(rng))
    rest = [Turn(rng.choice(FOLLOW_UPS), workload.lengths.draw(rng)) for _ in range(workload.turns - 1)]
    return [first, *rest]


def fixed_requests(workload: Workload, count: int) -> list[Turn]:
    """`count` single-turn requests, as the first turns of the workload's sessions."""
    rng = random.Random(workload.seed)
    return [draw_session(workload, rng)[0] for _ in range(count)]
