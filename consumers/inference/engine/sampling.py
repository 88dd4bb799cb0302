"""Per-request sampling parameters, token selection, and incremental detokenization.

Reproducibility contract: a request's tokens depend only on its own prompt, its
parameters and its seed, never on which other requests share its batch. Each sampled
request owns a CPU ``torch.Generator`` and draws exactly one uniform number from it per
step (inverse-CDF sampling), so batch composition cannot shift its random stream; the
global RNG is never touched.

Penalties and bias (OpenAI's presence_penalty, frequency_penalty, logit_bias) change a
row's logits before its temperature, greedy rows included, from that row's own tokens
generated so far; rows that ask for none are not touched (nor copied).

Log probabilities are the model's: log-softmax of the raw logits the token was chosen
from, before penalties, bias, temperature and top_p (vLLM's default, `raw_logprobs`), so
they do not change with how the token was sampled. Only rows that ask are computed.

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

# The request's parameters as its event holds them (ranges checked when it was decoded,
# what the engine cannot serve by the worker's intake, `SamplingParams.checked`); the
# defaults too, for the backends that send them on (upstream imports them from here).
from events.models import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, SamplingParams  # noqa: F401


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log probability and its most likely alternatives (id, logprob),
    most likely first: what crosses the engine process's pipe (ids; the worker spells them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


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


def pick_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    uniforms: list[float | None],
    generated: list[list[int]] | None = None,
) -> list[int | None]:
    """:func:`select_tokens` with the draws already taken (``uniforms[i]`` is None for greedy
    rows); ``generated[i]``: row i's tokens so far, which its penalties count."""
    logits = adjusted(logits.float(), params, generated)
    # One pass over the vocabulary for the greedy tokens and the check (each pass over a
    # batch's logits costs ~3 ms at 32 rows of 49,152): the max is NaN where a NaN is
    # anywhere, -inf where no logit is finite or +inf; either way the forward pass broke.
    best, tokens = logits.max(dim=-1)
    ok = ~best.isnan() & (best > -math.inf)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        every = len(sampled) == len(params)
        rows = torch.tensor(sampled, device=logits.device)
        temps = torch.tensor([params[i].temperature for i in sampled], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)
        u = torch.tensor([uniforms[i] for i in sampled], dtype=torch.float32, device=logits.device)
        picked, fine = _sample_top_p((logits if every else logits.index_select(0, rows)) / temps[:, None], top_p, u)
        tokens = picked if every else tokens.index_copy(0, rows, picked)
        ok = ok & fine if every else ok.index_copy(0, rows, ok.index_select(0, rows) & fine)
    return [t if good else None for t, good in zip(tokens.tolist(), ok.tolist(), strict=True)]


def adjusted(logits: torch.Tensor, params: list[SamplingParams], generated: list[list[int]] | None) -> torch.Tensor:
    """``logits`` ([batch, vocab], float) with each row's penalties and bias applied, row by
    row from the row's own tokens (OpenAI's formula: logit - count * frequency_penalty -
    (count > 0) * presence_penalty + bias); the same tensor when no row asks for any."""
    rows = [i for i, p in enumerate(params) if p.adjusts]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i in rows:
        p, row = params[i], logits[i]
        tokens = (generated[i] if generated is not None else []) if p.presence_penalty or p.frequency_penalty else []
        if tokens:
            counts = torch.bincount(torch.tensor(tokens, device=row.device), minlength=vocab)[:vocab].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias, strict=True)
            if max(ids) >= vocab:
                raise ValueError(f"logit_bias: token {max(ids)} is outside the model's vocabulary ({vocab} tokens)")
            row.index_add_(0, torch.tensor(ids, device=row.device), torch.tensor(bias, device=row.device))
    return logits


def token_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int | None]
) -> list[TokenLogprob | None]:
    """Each asking row's chosen token's log probability and its ``params.logprobs`` most
    likely alternatives, from the log-softmax of the row's raw logits (None for the other
    rows, and for a row with no token); nothing is computed when no row asks."""
    out: list[TokenLogprob | None] = [None] * len(params)
    rows = [i for i, (p, t) in enumerate(zip(params, tokens, strict=True)) if p.logprobs is not None and t is not None]
    if not rows:
        return out
    logp = torch.log_softmax(logits.index_select(0, torch.tensor(rows, device=logits.device)).float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor([[tokens[i]] for i in rows], device=logits.device)).squeeze(-1).tolist()
    k = max(params[i].logprobs or 0 for i in rows)
    top_lp, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    for r, i in enumerate(rows):
        n = params[i].logprobs or 0
        top = tuple(zip(top_ids[r, :n].tolist(), top_lp[r, :n].tolist(), strict=True))
        out[i] = TokenLogprob(int(tokens[i]), chosen[r], top)  # type: ignore[arg-type]
    return out


#: How many of a row's most likely tokens its nucleus is looked for among first: the
#: nucleus lies there when their mass reaches the row's top_p, and only a row whose
#: nucleus is wider is sorted whole (sorting a whole vocabulary for every row cost more
#: than the model's forward; docs/inference.md, Determinism).
NUCLEUS_CANDIDATES = 256


def _sample_top_p(
    logits: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling in the nucleus (the most likely tokens, each kept while the
    mass before it is below ``top_p``); also which rows had a proper distribution.

    A row of ``top_p`` 1 keeps every token: it is sampled in vocabulary order, unsorted.
    Another row looks for its nucleus among its NUCLEUS_CANDIDATES most likely tokens
    (in order), and is sorted whole only where their mass falls short of its ``top_p``."""
    probs = torch.softmax(logits, dim=-1)
    fine = ~probs.sum(dim=-1).isnan()  # a NaN anywhere (an overflow at a tiny temperature)
    picked = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
    whole = top_p >= 1.0
    if bool(whole.any()):
        rows = whole.nonzero().squeeze(-1)
        picked[rows] = _inverse_cdf(probs.index_select(0, rows), uniforms.index_select(0, rows))
    rest = (~whole).nonzero().squeeze(-1)
    if rest.numel():
        candidates, p, u = probs.index_select(0, rest), top_p.index_select(0, rest), uniforms.index_select(0, rest)
        top, order = candidates.topk(min(NUCLEUS_CANDIDATES, candidates.shape[-1]), dim=-1)  # most likely first
        wide = top.sum(dim=-1) < p  # the nucleus reaches past them: those rows are sorted whole
        chosen = torch.zeros_like(rest)
        if (few := (~wide).nonzero().squeeze(-1)).numel():
            chosen[few] = _in_nucleus(top[few], order[few], p[few], u[few])
        if (many := wide.nonzero().squeeze(-1)).numel():
            sorted_probs, sorted_order = candidates[many].sort(dim=-1, descending=True)
            chosen[many] = _in_nucleus(sorted_probs, sorted_order, p[many], u[many])
        picked[rest] = chosen
    return picked, fine


def _in_nucleus(
    sorted_probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """A token of each row's nucleus, by inverse CDF over its probabilities sorted most
    likely first (``order``: their token ids)."""
    # Keep a token while the mass before it is below top_p. The first is always kept,
    # also when top_p underflows to 0 in float32 (a top_p of 1e-300 means "the top token").
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < top_p[:, None]
    keep[:, 0] = True
    cdf = (sorted_probs * keep).cumsum(dim=-1)
    target = uniforms * cdf[:, -1]
    pos = torch.searchsorted(cdf, target[:, None], right=True)
    pos = torch.minimum(pos, keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    return order.gather(-1, pos).squeeze(-1)


#: The vocabulary is drawn from in blocks of this many tokens: the block by the
#: cumulative sums of the blocks' masses, then the token by those within its block (a
#: cumulative sum over the whole vocabulary is one sequential pass, ~4 ms at 32 rows).
CDF_BLOCK = 1024


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A token of each row drawn from its whole distribution, in vocabulary order, never
    one of probability 0 (where rounding between the block sums and the sums within a
    block lands on one, the row is drawn again over one cumulative sum of its vocabulary)."""
    rows, vocab = probs.shape
    pad = -vocab % CDF_BLOCK
    blocked = torch.nn.functional.pad(probs, (0, pad)).view(rows, -1, CDF_BLOCK)
    block_cdf = blocked.sum(dim=-1).cumsum(dim=-1)
    target = (uniforms * block_cdf[:, -1])[:, None]
    block = torch.searchsorted(block_cdf, target, right=True).clamp(max=block_cdf.shape[-1] - 1)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)
    inner = blocked[torch.arange(rows, device=probs.device), block.squeeze(-1)].cumsum(dim=-1)
    pos = torch.searchsorted(inner, target - before, right=True).clamp(max=CDF_BLOCK - 1)
    token = (block * CDF_BLOCK + pos).clamp(max=vocab - 1)
    zero = (probs.gather(-1, token) == 0).squeeze(-1)  # rare
    if bool(zero.any()):
        token[zero] = _inverse_cdf_whole(probs[zero], uniforms[zero])[:, None]
    return token.squeeze(-1)


def _inverse_cdf_whole(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """:func:`_inverse_cdf` over one cumulative sum of the vocabulary, clamped to the last
    token of nonzero probability."""
    cdf = probs.cumsum(dim=-1)
    pos = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, 0).amax(dim=-1, keepdim=True)
    return torch.minimum(pos, last).squeeze(-1)


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
