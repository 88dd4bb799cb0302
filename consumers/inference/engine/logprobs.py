"""Spelling the engine's log probabilities (token ids) as the event carries them: each
token's text and UTF-8 bytes, as OpenAI's API shows them.

A token's bytes are what it adds to the decoded text: a byte-level BPE (GPT-2, SmolLM2)
maps its token string back through the byte alphabet; a SentencePiece-style tokenizer
(Llama, stories260K) turns "▁" into a space and a byte-fallback token (``<0xE2>``) into
that byte. Its text is those bytes decoded, with U+FFFD where a character is split
between tokens (the `bytes` field keeps them whole). Spellings are cached per tokenizer.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from consumers.inference.engine.sampling import TokenLogprob
from events.models import TokenLogprob as TokenLogprobEvent
from events.models import TopLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPELLERS: weakref.WeakKeyDictionary[Any, Speller] = weakref.WeakKeyDictionary()


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character standing for each byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(visible, visible, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


class Speller:
    """A tokenizer's token ids -> (text, bytes), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") or {} if backend is not None else {}
        parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {p.get("type") for p in parts}
        self._byte_level = _byte_alphabet() if "ByteLevel" in kinds else None
        self._fallback = "ByteFallback" in kinds
        self._replace = [
            (p["pattern"]["String"], p["content"])
            for p in parts
            if p.get("type") == "Replace" and "String" in p.get("pattern", {})
        ]
        self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        if (found := self._cache.get(token_id)) is None:
            raw = self._bytes(token_id)
            found = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), tuple(raw))
        return found

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the tokenizer (a model's padded vocabulary)
            return b""
        if self._byte_level is not None:
            alphabet = self._byte_level
            return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in piece)
        if self._fallback and (m := _BYTE_TOKEN.fullmatch(piece)):
            return bytes([int(m[1], 16)])
        for pattern, content in self._replace:
            piece = piece.replace(pattern, content)
        return piece.encode()


class Pieces:
    """The spellings of a model whose tokenizer is not here (an upstream server's, which
    sends its tokens as text): each piece seen gets the next id, so the engine's token ids
    and log probabilities work as a local model's. Ids are this process's, counted in
    the chunks (``token_ids``) but meaningless elsewhere."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []
        self._lock = threading.Lock()

    def id(self, piece: str) -> int:
        with self._lock:
            if (found := self._ids.get(piece)) is None:
                found = self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            return found

    def __call__(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        piece = self._pieces[token_id]
        return piece, tuple(piece.encode())


def speller(tokenizer: Any) -> Callable[[int], tuple[str, tuple[int, ...]]]:
    """The tokenizer's speller (one per tokenizer, kept while it lives)."""
    if isinstance(tokenizer, Pieces):
        return tokenizer
    if (found := _SPELLERS.get(tokenizer)) is None:
        found = _SPELLERS[tokenizer] = Speller(tokenizer)
    return found


def spelled(logprobs: Sequence[TokenLogprob], spell: Callable[[int], tuple[str, tuple[int, ...]]]) -> tuple:
    """The event's log probabilities of the engine's."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        text, raw = spell(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=raw)

    out = []
    for lp in logprobs:
        text, raw = spell(lp.token_id)
        alternatives = tuple(top(t, v) for t, v in lp.top)
        out.append(TokenLogprobEvent(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=alternatives))
    return tuple(out)
