"""Hashed n-gram features of a prompt, computed with numpy only.

The classifier reads the sanitizer's *skeleton* of the original text (folded
look-alikes, no invisible characters, lower case), so a marker the sanitizer
removes still counts as evidence and obfuscation does not hide words.

Every n-gram is hashed with a polynomial hash taken from one prefix-sum array,
so character n-grams and words cost a few vectorized numpy operations whatever
the prompt's length; no Python loop runs per character or per word. Features
are binary (present or not) and the vector is L2-normalized, so one long benign
context cannot outvote an injected sentence by repetition alone.

Training and serving call the same :func:`featurize`: the hash is part of the
artifact's contract (``FEATURES_VERSION``), and a change to it must bump that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from consumers.filter.sanitize import skeleton

__all__ = ["FEATURES_VERSION", "Features", "featurize", "featurize_views", "gram_text"]

FEATURES_VERSION = "ngram-hash-1"
CHAR_ORDERS = (3, 4, 5)
WORD_ORDERS = (1, 2)  # the word view inside the linear model (``--words``)
WORD_KINDS = (1, 2, 3, 4)  # every word n-gram order there is a hash for (the TF-IDF stage reads up to 4)
# Long prompts are read as head + tail: it bounds the work per prompt, and an
# injection sits at the start or the end of what the model reads far more often
# than in the middle of a 20k-character paste.
MAX_CHARS = 16_000
_HALF = MAX_CHARS // 2

_MASK64 = (1 << 64) - 1
_M = 0x100000001B3  # odd, so invertible modulo 2**64
_M_INV = pow(_M, -1, 1 << 64)
_WORD_TABLE = np.array([chr(c).isalnum() or c == 0x5F for c in range(0x10000)], dtype=bool)
_KIND_SALT = {("c", n): np.uint64(0x9E3779B97F4A7C15 * (n + 1) & _MASK64) for n in CHAR_ORDERS} | {
    ("w", n): np.uint64(0xC2B2AE3D27D4EB4F * (n + 7) & _MASK64) for n in WORD_KINDS
}


def _powers(base: int, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint64)
    acc = 1
    for i in range(n):
        out[i] = acc
        acc = acc * base & _MASK64
    return out


_POW = _powers(_M, MAX_CHARS + 2)
_POW_INV = _powers(_M_INV, MAX_CHARS + 2)
_ARANGE = np.arange(MAX_CHARS + 2, dtype=np.int64)


# splitmix64's (shift, factor) steps, as numpy scalars made once (the last step has no factor)
_MIX_STEPS = tuple(
    (np.uint64(shift), np.uint64(factor) if factor else None)
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, 0))
)


def _mix(h: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, in place: spreads the polynomial hash over all 64 bits."""
    # in place with one scratch array: a fresh 12k-element array per step cost as much as the arithmetic
    tmp = np.empty_like(h)
    for shift, factor in _MIX_STEPS:
        np.right_shift(h, shift, out=tmp)
        np.bitwise_xor(h, tmp, out=h)
        if factor is not None:
            np.multiply(h, factor, out=h)
    return h


@dataclass(frozen=True)
class Features:
    """The distinct hashed features of one prompt, and every n-gram behind them."""

    text: str  # the normalized text the n-grams were taken from
    index: np.ndarray  # int64 feature indices, sorted, distinct
    raw: np.ndarray  # the feature index of every n-gram occurrence
    # per n-gram kind, in the order of ``raw``: where its occurrences start and end in ``text``
    # (joined only when asked: only explaining a score reads them)
    spans: tuple[tuple[np.ndarray, np.ndarray], ...] = ()
    counts: np.ndarray | None = None  # occurrences of each feature of ``index`` (term frequencies)

    @property
    def start(self) -> np.ndarray:
        return np.concatenate([s for s, _ in self.spans]) if self.spans else np.zeros(0, dtype=np.int64)

    @property
    def end(self) -> np.ndarray:
        return np.concatenate([e for _, e in self.spans]) if self.spans else np.zeros(0, dtype=np.int64)


def normalize(text: str) -> str:
    """Skeleton of ``text`` with whitespace runs collapsed, cut to head + tail."""
    folded = " ".join(skeleton(text).text.split())  # the same as re.sub(r"\s+", " ") + strip, twice as fast
    if len(folded) > MAX_CHARS:
        folded = folded[:_HALF] + " " + folded[-_HALF + 1 :]
    return folded


def featurize(
    text: str, bits: int, char_orders: tuple[int, ...] = CHAR_ORDERS, word_orders: tuple[int, ...] = WORD_ORDERS
) -> Features:
    """Hashed, distinct character 3-5-grams, words and word bigrams of ``text``.

    ``char_orders`` and ``word_orders`` (subsets of ``CHAR_ORDERS`` and ``WORD_KINDS``)
    select the feature kinds; the training command compares such families.
    """
    norm, prefix, cps = _prefix(text)
    return _hashed(norm, prefix, cps, bits, char_orders, word_orders)


def featurize_views(
    text: str, bits: int, char_orders: tuple[int, ...] = CHAR_ORDERS, word_orders: tuple[int, ...] = WORD_ORDERS
) -> tuple[Features, Features]:
    """The character n-grams and the word n-grams of ``text`` as two feature sets.

    Each set is normalized on its own by the classifier, so the few word features
    are not drowned by the many character ones; the text is normalized and
    prefix-summed once for both.
    """
    norm, prefix, cps = _prefix(text)
    return (
        _hashed(norm, prefix, cps, bits, char_orders, ()),
        _hashed(norm, prefix, cps, bits, (), word_orders),
    )


def _prefix(text: str) -> tuple[str, np.ndarray, np.ndarray]:
    norm = normalize(text)
    cps = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    cps += np.uint64(1)
    prefix = np.zeros(len(cps) + 1, dtype=np.uint64)
    np.multiply(cps, _POW_INV[: len(cps)], out=prefix[1:])
    np.add.accumulate(prefix[1:], out=prefix[1:])  # cumsum in place, without its Python wrapper
    return norm, prefix, cps


def _hashed(
    norm: str,
    prefix: np.ndarray,
    cps: np.ndarray,
    bits: int,
    char_orders: tuple[int, ...],
    word_orders: tuple[int, ...],
) -> Features:
    n = len(cps)
    # Every n-gram's hash is written into one preallocated array and mixed in place:
    # per prompt, numpy's per-call cost and fresh arrays weighed more than the arithmetic.
    orders = [order for order in char_orders if n >= order]
    ws, we = _word_spans(cps) if word_orders else (np.zeros(0, dtype=np.int64),) * 2
    word_kinds = [k for k in WORD_KINDS if k in word_orders and len(ws) >= k]
    sizes = [n - order + 1 for order in orders] + [len(ws) - k + 1 for k in word_kinds]
    hashes = np.empty(sum(sizes), dtype=np.uint64)
    pos = 0
    for order, m in zip(orders, sizes, strict=False):
        out = hashes[pos : pos + m]
        # slices, not fancy indexing: views of the prefix array, no gather
        np.subtract(prefix[order:], prefix[:m], out=out)
        np.multiply(out, _POW[:m], out=out)
        np.add(out, _KIND_SALT["c", order], out=out)
        pos += m
    if word_kinds:
        words = (prefix[we] - prefix[ws]) * _POW[ws]
        gram = words
        for k in range(1, word_kinds[-1] + 1):
            if k > 1:  # the k-gram: the (k-1)-gram's hash mixed, times M, plus the next word's
                gram = _mix(gram[:-1].copy()) * np.uint64(_M) + words[k - 1 :]
            if k in word_kinds:
                np.add(gram, _KIND_SALT["w", k], out=hashes[pos : pos + len(gram)])
                pos += len(gram)
    if not len(hashes):
        empty = np.zeros(0, dtype=np.int64)
        return Features(norm, empty, empty, counts=empty)
    raw = np.right_shift(_mix(hashes), np.uint64(64 - bits), out=hashes).view(np.int64)  # < 2**bits: same values
    # sort + neighbour test: several times faster than np.unique on these sizes; 32-bit
    # keys sort in half the time, and take() of the kept positions beats a boolean mask
    ordered = np.sort(raw.astype(np.int32) if bits < 32 else raw)
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    firsts = np.flatnonzero(keep)
    index = ordered.take(firsts).astype(np.int64, copy=False)
    counts = np.diff(firsts, append=len(ordered))
    spans = [(_ARANGE[: n - order + 1], _ARANGE[order : n + 1]) for order in orders]
    word_spans = [(ws[: len(ws) - k + 1], we[k - 1 :]) for k in word_kinds]
    return Features(norm, index, raw, (*spans, *word_spans), counts)


def _word_spans(cps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end offsets of maximal runs of word characters (\\w, roughly)."""
    # Code points past the table (emoji, rare CJK) count as word characters.
    inside = np.where(cps <= 0x10000, _WORD_TABLE[np.minimum(cps - np.uint64(1), 0xFFFF).astype(np.int64)], True)
    if not inside.any():
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    edges = np.diff(np.concatenate(([False], inside, [False])).astype(np.int8))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def gram_text(features: Features, feature: int) -> str:
    """The first n-gram hashed to ``feature``, as the classifier saw it."""
    hits = np.flatnonzero(features.raw == feature)
    if not len(hits):
        return ""
    pos = int(hits[0])
    for starts, ends in features.spans:  # the kind it belongs to, then its place there
        if pos < len(starts):
            return features.text[starts[pos] : ends[pos]]
        pos -= len(starts)
    return ""
