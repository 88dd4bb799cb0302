"""Keys and values of finished sequences, kept so a later prompt that starts with the
same tokens (a conversation's next turn) prefills only what is new.

A sequence's keys and values depend on its tokens and the weights alone (causal
attention, positions counted from 0), so the first ``r`` columns of any finished
sequence serve any prompt whose first ``r`` tokens are the same. The cache holds whole
sequences, not pages: one entry per finished answer (its prompt, and its answer up to
the last token fed to the model), found by its token prefix. As in vLLM's automatic
prefix caching, prefixes are found by a chain of block hashes (a block's hash covers
every token before it), here pointing to the entries that hold that block prefix; the
match is then extended token by token past the last whole block and checked, so a hash
collision can cost a lookup, never a wrong reuse.

A conversation's turn N+1 renders its history as turn N's prompt, turn N's answer and
the end-of-turn token the engine stopped on, so turn N's entry covers all of it but that
last token. Where a template renders the history otherwise (re-tokenized text that
splits differently), the match ends where the tokens part and only what follows is
prefilled. An entry that another one extends (the previous turn's) is dropped when the
longer one is stored: each conversation holds one entry. Entries leave least recently
used first once their bytes pass the budget. Pure logic: the entries' values are opaque
here (the engine stores tensors) with the size the caller gives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

#: Tokens per hashed block. A prompt shares nothing found unless it matches at least one
#: whole block (vLLM's default block size).
BLOCK = 16


@dataclass(frozen=True)
class PrefixStats:
    """Running totals of one cache (an engine's), for the worker's metrics."""

    hits: int = 0  # lookups that reused a prefix
    misses: int = 0  # lookups that found none
    reused_tokens: int = 0  # prompt tokens not prefilled thanks to a hit
    evictions: int = 0  # entries dropped for the budget (not those an extension replaced)
    entries: int = 0
    bytes: int = 0


@dataclass
class Entry:
    ids: tuple[int, ...]
    value: Any
    nbytes: int
    hashes: list[int]


@dataclass(frozen=True)
class Hit:
    """A prompt's first ``tokens`` tokens are ``entry``'s first ``tokens``."""

    tokens: int
    value: Any


def block_hashes(ids: Sequence[int], block: int = BLOCK) -> list[int]:
    """The chain hash of each whole block of ``ids``: hash i covers tokens [0, (i+1)*block)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start : start + block])))
        out.append(h)
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Finished sequences' values by token prefix, least recently used out past ``budget_bytes``."""

    def __init__(self, budget_bytes: int, block: int = BLOCK) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.block = block
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._index: dict[int, set[int]] = {}  # block-prefix hash -> entries holding that prefix
        self._keys = count()
        self._bytes = 0
        self._hits = self._misses = self._reused = self._evictions = 0

    @property
    def stats(self) -> PrefixStats:
        return PrefixStats(self._hits, self._misses, self._reused, self._evictions, len(self._entries), self._bytes)

    def lookup(self, ids: Sequence[int]) -> Hit | None:
        """The longest stored prefix of ``ids`` to reuse, leaving at least one token to
        compute (the prompt's last token gives the first logits); None: a miss."""
        key, shared = self._longest(ids, block_hashes(ids, self.block))
        reuse = min(shared, len(ids) - 1)
        if key is None or reuse < self.block:
            self._misses += 1
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        self._reused += reuse
        return Hit(reuse, self._entries[key].value)

    def store(self, ids: Sequence[int], value: Any, nbytes: int) -> bool:
        """Keep ``value`` (``nbytes``) for the sequence ``ids``; entries it extends are
        dropped. False when it is not kept (too short to find, or over the budget alone)."""
        if len(ids) < self.block or nbytes > self.budget_bytes:
            return False
        ids = tuple(ids)
        hashes = block_hashes(ids, self.block)
        for key in {k for h in hashes for k in self._index.get(h, ())}:
            held = self._entries[key].ids
            if len(held) >= len(ids) and held[: len(ids)] == ids:  # already held, within a longer one
                self._entries.move_to_end(key)
                return True
            if held == ids[: len(held)]:
                self._remove(key)
        key = next(self._keys)
        self._entries[key] = Entry(ids, value, nbytes, hashes)
        self._bytes += nbytes
        for h in hashes:
            self._index.setdefault(h, set()).add(key)
        while self._bytes > self.budget_bytes:
            self._remove(next(iter(self._entries)))
            self._evictions += 1
        return True

    def clear(self) -> None:
        for key in list(self._entries):
            self._remove(key)

    def _longest(self, ids: Sequence[int], hashes: list[int]) -> tuple[int | None, int]:
        """The entry sharing the most leading tokens with ``ids``, and how many."""
        found: set[int] = set()
        for h in hashes:
            keys = self._index.get(h)
            if not keys:
                break
            found = keys
        best, shared = None, 0
        for key in found:
            n = common_prefix(self._entries[key].ids, ids)
            if n > shared:
                best, shared = key, n
        return best, shared

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        for h in entry.hashes:
            keys = self._index.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[h]
