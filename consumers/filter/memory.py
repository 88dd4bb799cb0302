"""Known-attack memory: how much of an attack seen in training a prompt contains.

A jailbreak request that was caught once tends to come back inside a new wrapper: the
same harmful request with an optimized suffix appended (GCG), inside a template
(AIM, random search), or as a bare request (DSN). The linear views see such a prompt
diluted: every n-gram of the wrapper weighs as much as the request's. The memory asks
the other question, how much of one known attack the prompt contains, the way a
vector store of known attacks does (Rebuff, Lakera), but exactly and in microseconds:

* a prompt's *shingles* are the distinct hashes of its word 3-grams (the cue view's
  tokens: ASCII words and sentence ends of the classifier's normalized text);
* each training attack keeps a bottom-k sketch, its ``SKETCH`` smallest shingle hashes
  among those no benign training prompt has: a uniform sample of what is its own (an
  e-mail with an injected instruction keeps the instruction, not the e-mail that benign
  prompts share); an attack left with fewer than ``MIN_SHINGLES`` is not stored, nor one
  longer than ``MAX_SHINGLES`` (about 66 words), nor one of more than ``MAX_LINES``
  non-empty lines: a long attack, or a short one laid out as a document (a table, an
  e-mail, code), is mostly context that a benign prompt may share, even when no benign
  training prompt did, while the requests that come back in new wrappers are short and
  read as a few lines of prose. (Attack families held out, issue 33's protocol: storing
  short documents let a benign table or e-mail that an injected training attack carried
  score +5 to +8 and set the benign tail; without them 59.2% -> 62.6%, docs/filter.md);
* a prompt's containment of attack A is (A's sketched shingles found in the prompt) /
  (A's sketch size + ``SMOOTH``), an estimate of the share of A inside the prompt, shrunk
  for short attacks; the memory's value is the largest over the stored attacks, and
  ``weight`` times it is added to the classifier's logit.

It recognizes attacks seen in training and their near copies; it adds nothing for an
attack family never seen (docs/filter.md measures both). Non-ASCII text has no tokens,
so translated attacks are not remembered.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MEMORY_VERSION", "Memory", "lines", "shingles"]

MEMORY_VERSION = "words3-bottom32"
SHINGLE = 3  # words per shingle
SKETCH = 32  # shingle hashes kept per stored attack (the smallest: a bottom-k sample)
MIN_SHINGLES = 6  # shorter attacks are not stored
MAX_SHINGLES = 64  # nor longer ones (with no cap, in-distribution 5-fold fell from 84% to 59%: docs/filter.md)
MAX_LINES = 4  # nor one laid out as a document: more non-empty lines than this
SMOOTH = 8.0  # containment = found / (kept + SMOOTH)
WEIGHT = 8.0  # logit added at containment 1 (chosen on the dev split among 4 to 12; docs/filter.md)

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_EMPTY = np.zeros(0, dtype=np.uint32)


def lines(text: str) -> int:
    """Non-empty lines of ``text`` (an attack of more than ``MAX_LINES`` is not stored)."""
    return sum(1 for line in text.splitlines() if line.strip())


def shingles(tokens: list[bytes]) -> np.ndarray:
    """Sorted distinct uint32 hashes of the word 3-grams of ``tokens`` (cues.cue_tokens)."""
    if len(tokens) < SHINGLE:
        return _EMPTY
    w = np.fromiter(map(zlib.crc32, tokens), dtype=np.uint64, count=len(tokens))
    h = w[:-2] * _M1
    h += w[1:-1]
    h *= _M2
    h += w[2:]  # wraps modulo 2**64
    h ^= h >> np.uint64(29)
    h *= _M1
    # the high 32 bits, sorted, each once (sort + neighbour test: faster than np.unique here)
    out = np.sort((h >> np.uint64(32)).astype(np.uint32))
    if len(out) > 1:
        out = out[np.concatenate(([True], out[1:] != out[:-1]))]
    return out


@dataclass(frozen=True)
class Memory:
    """Bottom-k sketches of the stored attacks, and an inverted index over them."""

    sketches: np.ndarray  # (attacks, SKETCH) uint32; row i's first sizes[i] entries are real
    sizes: np.ndarray  # (attacks,) uint8
    weight: float = WEIGHT
    smooth: float = SMOOTH
    # the inverted index, built from the sketches: distinct shingles (sorted), where each one's
    # owners start in _owner and how many there are, and 1 / (size + smooth) per stored attack
    _keys: np.ndarray = field(init=False, repr=False, compare=False)
    _start: np.ndarray = field(init=False, repr=False, compare=False)
    _count: np.ndarray = field(init=False, repr=False, compare=False)
    _owner: np.ndarray = field(init=False, repr=False, compare=False)
    _inverse: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        real = np.arange(self.sketches.shape[1]) < self.sizes[:, None].astype(np.int64)
        keys = self.sketches[real]
        owner = np.broadcast_to(np.arange(len(self.sizes))[:, None], self.sketches.shape)[real]
        order = np.argsort(keys, kind="stable")
        keys, owner = keys[order], owner[order]
        # each distinct shingle once, and where its owners start in ``_owner``
        first = np.concatenate(([True], keys[1:] != keys[:-1])) if len(keys) else np.zeros(0, dtype=bool)
        object.__setattr__(self, "_keys", keys[first])
        bounds = np.append(np.flatnonzero(first), len(keys))
        object.__setattr__(self, "_start", bounds[:-1])
        object.__setattr__(self, "_count", np.diff(bounds))
        object.__setattr__(self, "_owner", owner.astype(np.intp))
        object.__setattr__(self, "_inverse", 1.0 / (self.sizes.astype(np.float64) + self.smooth))

    @classmethod
    def build(
        cls,
        attack_shingles: Sequence[np.ndarray],
        benign_shingles: Sequence[np.ndarray] = (),
        weight: float = WEIGHT,
        smooth: float = SMOOTH,
        attack_lines: Sequence[int] | None = None,
    ) -> Memory:
        """A memory of the attacks whose shingles are given (each sorted, distinct), less every
        shingle of the benign prompts given; with ``attack_lines`` (each attack's :func:`lines`),
        an attack of more than ``MAX_LINES`` is not stored."""
        own = list(attack_shingles)
        laid_out = attack_lines if attack_lines is not None else [1] * len(own)
        if len(benign_shingles) and own:
            # one membership test over every attack shingle at once, then cut back per attack
            shared = np.isin(np.concatenate(own), np.concatenate(benign_shingles))
            ends = np.cumsum([len(s) for s in own])
            own = [s[~m] for s, m in zip(own, np.split(shared, ends[:-1]), strict=True)]
        kept = [
            s[:SKETCH]
            for s, a, n in zip(own, attack_shingles, laid_out, strict=True)
            if len(s) >= MIN_SHINGLES and len(a) <= MAX_SHINGLES and n <= MAX_LINES
        ]
        sketches = np.zeros((len(kept), SKETCH), dtype=np.uint32)
        for i, s in enumerate(kept):
            sketches[i, : len(s)] = s
        return cls(sketches, np.array([len(s) for s in kept], dtype=np.uint8), weight, smooth)

    def __len__(self) -> int:
        return len(self.sizes)

    def containment(self, prompt_shingles: np.ndarray) -> float:
        """The largest share of one stored attack found in the prompt (0 when none)."""
        keys = self._keys
        if not len(prompt_shingles) or not len(keys):
            return 0.0
        at = np.searchsorted(keys, prompt_shingles)
        np.minimum(at, len(keys) - 1, out=at)  # past the end: compared with the last key, and not equal
        found = keys[at] == prompt_shingles
        if not found.any():  # no stored shingle in the prompt
            return 0.0
        at = at[found]
        lo, n = self._start[at], self._count[at]
        # every owner position lo[i] .. lo[i] + n[i] - 1, as one index array
        where = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))
        hits = np.bincount(self._owner[where], minlength=len(self.sizes))
        hits = hits * self._inverse
        return float(hits.max())

    def logit(self, prompt_shingles: np.ndarray) -> float:
        return self.weight * self.containment(prompt_shingles)

    def arrays(self) -> dict[str, np.ndarray]:
        """What an artifact stores (classifier.save_linear)."""
        return {"memory_sketches": self.sketches, "memory_sizes": self.sizes}

    def meta(self) -> dict[str, Any]:
        return {
            "version": MEMORY_VERSION,
            "attacks": len(self),
            "weight": self.weight,
            "smooth": self.smooth,
            "sketch": SKETCH,
            "shingle": SHINGLE,
            "min_shingles": MIN_SHINGLES,
            "max_shingles": MAX_SHINGLES,
            "max_lines": MAX_LINES,
        }

    @classmethod
    def load(cls, arrays: Any, meta: dict[str, Any]) -> Memory:
        if meta.get("version") != MEMORY_VERSION:
            raise ValueError(f"artifact memory {meta.get('version')!r} differs from this code's {MEMORY_VERSION!r}")
        sketches = np.asarray(arrays["memory_sketches"], dtype=np.uint32)
        sizes = np.asarray(arrays["memory_sizes"], dtype=np.uint8)
        if sketches.ndim != 2 or sketches.shape != (len(sizes), SKETCH) or (sizes > SKETCH).any():
            raise ValueError(f"artifact memory has shape {sketches.shape} for {len(sizes)} attacks")
        return cls(sketches, sizes, float(meta["weight"]), float(meta["smooth"]))
