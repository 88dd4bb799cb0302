"""Per-request sampling parameters, token selection, and incremental detokenization.

Reproducibility contract: a request's tokens depend only on its own prompt, its
parameters and its seed, never on which other requests share its batch. Each sampled
request owns a CPU ``torch.Generator`` and draws exactly one uniform number from it per
step (inverse-CDF sampling), so batch composition cannot shift its random stream; the
global RNG is never touched.

Poison isolation: a row that cannot be sampled (its logits hold a NaN, or its
distribution does not survive the temperature) yields ``None`` instead of a token, so
the engine can end that request alone; the draw was taken before any computation, so
neighbours' streams are unaffected whatever happens to the row.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers.decoders import DecodeStream

from events.models import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_P, MIN_TEMPERATURE

"""The smallest non-zero temperature served. Smaller ones sharpen the distribution into
an argmax anyway, and far smaller ones underflow to 0 in float32 (1e-300) or overflow
the scaled logits (1e-40), which leaves nothing to sample; ask for 0 (greedy) instead."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request."""

    temperature: float = DEFAULT_TEMPERATURE  # 0 means greedy (argmax); top_p and seed are then unused
    top_p: float = DEFAULT_TOP_P  # nucleus: sample among the smallest set of tokens with this much mass
    max_tokens: int = DEFAULT_MAX_TOKENS  # completion tokens at most (the engine may clamp it to the context)
    stop: tuple[str, ...] = ()  # generation ends before the first occurrence of any of these
    seed: int | None = None  # None draws a fresh seed per request (not reproducible)

    def __post_init__(self) -> None:
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        # Accept any iterable (a list from JSON) but store a tuple so params stay hashable.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's private RNG, or None for greedy requests."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator(device="cpu").manual_seed(seed)


def draw_uniforms(params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[float | None]:
    """This step's one draw per sampled row (None for greedy rows), from the row's own RNG.

    Drawn apart from the selection, so that a selection that fails and is retried row
    by row never draws twice.
    """
    return [None if p.greedy else float(torch.rand(1, generator=g)) for p, g in zip(params, generators, strict=True)]


def select_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int | None]:
    """Pick one token per row of ``logits`` ([batch, vocab]) under each row's params.

    Every row is computed independently of the others (row-wise ops only), and every
    sampled row consumes exactly one draw from its own generator. A row that cannot be
    sampled yields None.
    """
    return pick_tokens(logits, params, draw_uniforms(params, generators))


def pick_tokens(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float | None]) -> list[int | None]:
    """:func:`select_tokens` with the draws already taken (``uniforms[i]`` is None for greedy rows)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    # A NaN anywhere, or no finite-or-+inf logit at all, means the forward pass broke for this row.
    ok = ~logits.isnan().any(dim=-1) & (logits > -math.inf).any(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)
        u = torch.tensor([uniforms[i] for i in sampled], dtype=torch.float32, device=logits.device)
        picked, fine = _sample_top_p(logits.index_select(0, rows) / temps[:, None], top_p, u)
        tokens = tokens.index_copy(0, rows, picked)
        ok = ok.index_copy(0, rows, ok.index_select(0, rows) & fine)
    return [t if good else None for t, good in zip(tokens.tolist(), ok.tolist(), strict=True)]


def _sample_top_p(
    logits: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling in the nucleus; also which rows had a proper distribution."""
    probs = torch.softmax(logits, dim=-1)
    fine = ~probs.isnan().any(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Keep a token while the mass before it is below top_p. The first is always kept,
    # also when top_p underflows to 0 in float32 (a top_p of 1e-300 means "the top token").
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]
    keep[:, 0] = True
    cdf = (sorted_probs * keep).cumsum(dim=-1)
    target = uniforms * cdf[:, -1]
    pos = torch.searchsorted(cdf, target[:, None], right=True)
    pos = torch.minimum(pos, keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    return order.gather(-1, pos).squeeze(-1), fine


@dataclass
class TextTracker:
    """Turns a request's generated token ids into text deltas and applies stop strings.

    Text is decoded together with a few prompt tokens so that tokenizers that drop a
    leading space at the start of a decode (SentencePiece) still produce it. A delta
    never ends inside a multi-byte character (the replacement character marks an
    incomplete one; a special token, which decodes to nothing, is none, and a character
    the end cuts off is left out), and never ends with text that could be the start of a
    stop string: that tail is held back until it is resolved or the request finishes.

    With a fast (Rust) tokenizer the text grows by one streaming decode per token
    (`tokenizers.decoders.DecodeStream`, a few microseconds); otherwise the whole
    completion is decoded again at every token, which grows with its length.
    """

    tokenizer: Any
    prompt_ids: list[int]
    stop: tuple[str, ...] = ()
    _prefix_ids: list[int] = field(init=False)
    _prefix_len: int = field(init=False)
    _ids: list[int] = field(init=False, default_factory=list)
    _emitted: int = field(init=False, default=0)
    _stream: Any = field(init=False, default=None)
    _decoded: str = field(init=False, default="")  # the whole completion as decoded so far
    _special: frozenset[int] = field(init=False, default=frozenset())  # skipped by the stream
    _partial: bool = field(init=False, default=False)  # the stream holds part of a character
    text: str = field(init=False, default="")  # the completion so far, stop-trimmed
    stopped: bool = field(init=False, default=False)

    _PREFIX_TOKENS = 4

    def __post_init__(self) -> None:
        self._prefix_ids = list(self.prompt_ids[-self._PREFIX_TOKENS :])
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._stream = (backend, DecodeStream(ids=self._prefix_ids, skip_special_tokens=True))
            self._special = special_ids(backend)
        else:
            self._prefix_len = len(self._decode(self._prefix_ids))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _completion(self, token_id: int) -> str:
        """The whole completion's text with ``token_id``; ends with U+FFFD inside a character."""
        self._ids.append(token_id)
        if self._stream is not None:
            backend, stream = self._stream
            try:
                piece = stream.step(backend, token_id)
            except Exception:  # noqa: BLE001 - see below
                # DecodeStream refuses some byte sequences that are no UTF-8 (a stray
                # continuation byte, then a word: "Invalid prefix encountered"); the
                # request is fine, so it goes on with whole decodes from here.
                self._stream = None
                self._prefix_len = len(self._decode(self._prefix_ids))
            else:
                # None: inside a multi-byte character, or a special token skipped (an
                # end-of-turn token, which must not read as half a character).
                if piece is None and token_id not in self._special:
                    self._partial = True
                elif piece is not None:
                    self._decoded, self._partial = self._decoded + piece, False
                return self._decoded + "\ufffd" if self._partial else self._decoded
        return self._decode(self._prefix_ids + self._ids)[self._prefix_len :]

    def add(self, token_id: int) -> str:
        """Append a token; return the new text that is safe to emit (may be empty)."""
        full = self._completion(token_id)
        if self.stop:
            cut = _first_stop(full, self.stop, start=self._emitted)
            if cut is not None:
                self.stopped = True
                self.text = full[:cut]
                return self._emit(cut)
        self.text = full
        if full.endswith("\ufffd"):
            return ""
        return self._emit(len(full) - _partial_stop_len(full, self.stop))

    def flush(self) -> str:
        """The held-back tail, at the end of generation; a character cut off by the end
        (``max_tokens`` reached inside it) is left out, never shown as U+FFFD."""
        if self._partial and not self.stopped:
            self.text = self.text.removesuffix("\ufffd")
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta


def special_ids(backend: Any) -> frozenset[int]:
    """The ids a decode with ``skip_special_tokens`` leaves out (a fast tokenizer's backend)."""
    return frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    # Emitted text never ends with the start of a stop string (that tail is held
    # back), so a stop string can only begin at or after ``start``.
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
