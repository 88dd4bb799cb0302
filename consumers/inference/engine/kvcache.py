"""The running batch's KV cache, preallocated and written in place.

Layout. Every layer's keys and values live in one buffer ``[rows, heads, columns,
head_dim]`` allocated ahead of need; the running batch is rows ``[0, n)`` and columns
``[start, end)`` of it (the *window*), left-padded so every row's last token is in
column ``end - 1``; ``mask`` (same rows and columns) marks real tokens. A decode step
writes each row's new key and value into column ``end`` (one slice assignment per
layer, no copy of what is cached) and the model attends over a view of the window.

What used to copy the whole cache now copies little or nothing:

- a finished row is replaced by the last rows of the batch (only the moved rows are
  copied), so the batch stays rows ``[0, n)``;
- leading columns that are padding in every row are dropped by moving ``start``;
- newcomers are written into rows ``[n, n + k)``, right-aligned to ``end``;
- only when the buffer runs out of columns or rows is the window copied, once, into a
  new buffer with room to spare (every ~window steps at a steady load, not every step).

Masked columns must hold finite numbers (attention multiplies them by a zero weight, and
a NaN left by a poisoned row's earlier occupant would survive that), so every column a
row attends over that is not its own is zeroed when the row is written.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

KV = tuple[torch.Tensor, torch.Tensor]  # one layer's keys and values, [rows, heads, columns, head_dim]

#: Spare columns a new buffer gets beyond what it must hold: this many decode steps (or
#: the window's width, if wider) before the window is copied to the start again.
HEADROOM = 64


def bytes_per_token(model: Any) -> int:
    """What one token of one row costs in the slab: keys and values of every layer."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize


class KVSlab:
    """Preallocated KV cache of a running batch (see the module docstring)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask_buf: torch.Tensor | None = None
        self.n = 0
        self.start = 0
        self.end = 0

    # ---- reading -------------------------------------------------------------------

    @property
    def width(self) -> int:
        return self.end - self.start

    @property
    def mask(self) -> torch.Tensor:
        """The running batch's ``[n, width]`` mask (a view)."""
        assert self.mask_buf is not None, "empty slab"
        return self.mask_buf[: self.n, self.start : self.end]

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s cached keys and values of the running batch (views)."""
        return (
            self.keys[layer][: self.n, :, self.start : self.end],
            self.values[layer][: self.n, :, self.start : self.end],
        )

    # ---- a decode step -------------------------------------------------------------

    def step_inputs(self) -> tuple[Cache, torch.Tensor]:
        """A cache writing one new column for every row in place, and the mask that
        attends over it; :meth:`commit` makes the column part of the window."""
        if self.end + 1 > self._columns:
            self._relocate(self.n, self.width, self.width + 1)
        assert self.mask_buf is not None
        self.mask_buf[: self.n, self.end] = 1
        cache = Cache(layers=[_SlabLayer(self, i) for i in range(len(self.keys))])
        return cache, self.mask_buf[: self.n, self.start : self.end + 1]

    def commit(self) -> None:
        self.end += 1

    # ---- rows joining and leaving ----------------------------------------------------

    def add(self, layers: list[KV], mask: torch.Tensor) -> None:
        """Append prefilled rows (each layer's keys and values, with their ``[k, w]`` mask) to the batch."""
        k, w = mask.shape
        if not self.keys:
            self._allocate(layers[0][0], layers[0][1], len(layers), k, w + max(HEADROOM, w))
        if self.n == 0 and w < self._columns:  # an empty batch starts over at the left
            self.start = self.end = w
        width = max(self.width, w)
        if self.n + k > self._rows or self.end < width:
            self._relocate(self.n + k, width, width + 1)
        if self.end - w < self.start:  # the window widens to the left: clear it for the rows in it
            old, self.start = self.start, self.end - w
            self._clear(0, self.n, self.start, old)
        rows = slice(self.n, self.n + k)
        self._clear(self.n, self.n + k, self.start, self.end - w)
        for (keys, values), kb, vb in zip(layers, self.keys, self.values, strict=True):
            kb[rows, :, self.end - w : self.end] = keys
            vb[rows, :, self.end - w : self.end] = values
        assert self.mask_buf is not None
        self.mask_buf[rows, self.end - w : self.end] = mask
        self.n += k

    def keep(self, rows: list[int]) -> list[int]:
        """Keep ``rows`` (ascending) and drop the others; returns the kept rows in their
        new order (rows past the new end of the batch move into the holes), for the
        caller to reorder what it keeps per row the same way."""
        n = len(rows)
        kept = set(rows)
        holes = [i for i in range(n) if i not in kept]
        movers = [r for r in rows if r >= n]
        order = list(rows[: n - len(movers)])
        if holes:
            src = torch.tensor(movers, device=self._device)
            dst = torch.tensor(holes, device=self._device)
            cols = slice(self.start, self.end)
            for buf in (*self.keys, *self.values):
                buf[dst, :, cols] = buf[src, :, cols]
            assert self.mask_buf is not None
            self.mask_buf[dst, cols] = self.mask_buf[src, cols]
            order = list(range(n))
            for h, m in zip(holes, movers, strict=True):
                order[h] = m
        self.n = n
        self._trim()
        return order

    def reset(self, layers: list[KV] | None = None, mask: torch.Tensor | None = None) -> None:
        """Empty the batch; then hold ``layers``' rows if given (after a step ran in parts)."""
        self.n = 0
        self.start = self.end
        if layers is not None and mask is not None:
            self.add(layers, mask)

    def snapshot(self, rows: torch.Tensor) -> list[KV]:
        """Copies of ``rows``' cached keys and values (to run part of the batch on its own)."""
        return [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in map(self.window, range(len(self.keys)))]

    def row(self, row: int, n: int) -> list[KV] | None:
        """Copies of ``row``'s keys and values, ``[1, heads, n, head_dim]`` per layer: its
        last ``n`` columns, which are its tokens when it has ``n`` (else None)."""
        assert self.mask_buf is not None
        if n > self.width or int(self.mask_buf[row, self.start : self.end].sum()) != n:
            return None
        cols = slice(self.end - n, self.end)
        return [
            (k[row : row + 1, :, cols].clone(), v[row : row + 1, :, cols].clone())
            for k, v in zip(self.keys, self.values, strict=True)
        ]

    # ---- buffers -------------------------------------------------------------------

    @property
    def _rows(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def _columns(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def _device(self) -> torch.device:
        return self.keys[0].device

    def _trim(self) -> None:
        """Drop leading columns that are padding in every row."""
        if self.n == 0:
            self.start = self.end
            return
        first = int(self.mask.any(dim=0).long().argmax())
        self.start += first

    def _clear(self, row0: int, row1: int, col0: int, col1: int) -> None:
        if row1 <= row0 or col1 <= col0:
            return
        for buf in (*self.keys, *self.values):
            buf[row0:row1, :, col0:col1] = 0
        assert self.mask_buf is not None
        self.mask_buf[row0:row1, col0:col1] = 0

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor, layers: int, rows: int, columns: int) -> None:
        rows = min(self.max_rows, max(rows, 1))
        kshape = (rows, keys.shape[1], columns, keys.shape[3])
        vshape = (rows, values.shape[1], columns, values.shape[3])
        self.keys = [keys.new_zeros(kshape) for _ in range(layers)]
        self.values = [values.new_zeros(vshape) for _ in range(layers)]
        self.mask_buf = torch.zeros((rows, columns), dtype=torch.long, device=keys.device)

    def _relocate(self, rows: int, width: int, need: int) -> None:
        """Copy the window into new buffers holding ``rows`` rows, a window of ``width``
        columns ending at ``end`` (wider than now: padding on the left) and room for
        ``need - width`` more columns, with spare room besides."""
        old_k, old_v, old_mask = self.keys, self.values, self.mask_buf
        assert old_mask is not None
        cur = self.width
        rows = max(rows, min(self.max_rows, 2 * self._rows)) if rows > self._rows else self._rows
        self._allocate(old_k[0], old_v[0], len(old_k), rows, need + max(HEADROOM, width))
        src = slice(self.start, self.end)
        dst = slice(width - cur, width)
        for new, old in zip((*self.keys, *self.values), (*old_k, *old_v), strict=True):
            new[: self.n, :, dst] = old[: self.n, :, src]
        assert self.mask_buf is not None
        self.mask_buf[: self.n, dst] = old_mask[: self.n, src]
        self.start, self.end = width - cur, width


class _SlabLayer(DynamicLayer):
    """One layer of a decode step's cache: writes the step's column into the slab in
    place and gives attention a view of the window with it."""

    def __init__(self, slab: KVSlab, index: int) -> None:
        super().__init__()
        self.slab = slab
        self.index = index
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.slab
        q = key_states.shape[-2]
        kb, vb = s.keys[self.index], s.values[self.index]
        kb[: s.n, :, s.end : s.end + q] = key_states
        vb[: s.n, :, s.end : s.end + q] = value_states
        self.keys, self.values = kb[: s.n, :, s.start : s.end + q], vb[: s.n, :, s.start : s.end + q]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.slab.width

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slab.width + query_length, 0
