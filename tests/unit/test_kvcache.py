"""The preallocated KV cache's bookkeeping, on synthetic tensors (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from consumers.inference.engine import kvcache
from consumers.inference.engine.kvcache import KVSlab

pytestmark = pytest.mark.timeout(30)

LAYERS, HEADS, DIM = 2, 2, 3


def prefill(values: list[float], widths: list[int], w: int | None = None) -> tuple[list, torch.Tensor]:
    """A prefilled batch: row i holds widths[i] tokens, every key/value of them = values[i]
    (+ the layer index), left-padded to ``w`` with zeros."""
    w = w or max(widths)
    mask = torch.zeros(len(values), w, dtype=torch.long)
    kv = torch.zeros(len(values), HEADS, w, DIM)
    for i, (v, n) in enumerate(zip(values, widths, strict=True)):
        mask[i, w - n :] = 1
        kv[i, :, w - n :] = v
    return [(kv + layer, kv + layer) for layer in range(LAYERS)], mask


def row_values(slab: KVSlab, layer: int = 0) -> list[list[float]]:
    """Per running row, the value of each of its real tokens in the window (layer 0: as given)."""
    keys, values = slab.window(layer)
    assert torch.equal(keys, values)
    out = []
    for r in range(slab.n):
        cols = slab.mask[r].nonzero().flatten()
        out.append([float(keys[r, 0, c, 0]) - layer for c in cols])
    return out


def decode(slab: KVSlab, new: list[float]) -> None:
    """One step: every layer writes the rows' new column in place, as the model would."""
    cache, mask = slab.step_inputs()
    assert mask.shape == (slab.n, slab.width + 1) and bool(mask[:, -1].all())
    for layer in range(LAYERS):
        col = torch.tensor(new).view(-1, 1, 1, 1).expand(slab.n, HEADS, 1, DIM) + layer
        keys, _ = cache.update(col, col.clone(), layer)
        assert keys.shape[2] == slab.width + 1
    slab.commit()


def test_rows_join_decode_and_leave_keeping_their_tokens():
    slab = KVSlab(max_rows=8)
    slab.add(*prefill([1.0, 2.0], [3, 1]))
    assert row_values(slab) == [[1, 1, 1], [2]]
    decode(slab, [10.0, 20.0])
    slab.add(*prefill([3.0, 4.0, 5.0], [2, 5, 1]))  # wider than the window: it widens to the left
    assert slab.width == 5
    assert row_values(slab) == [[1, 1, 1, 10], [2, 20], [3, 3], [4] * 5, [5]]
    assert row_values(slab, layer=1) == row_values(slab)
    decode(slab, [11.0, 21.0, 31.0, 41.0, 51.0])
    order = slab.keep([1, 2, 4])  # rows 0 and 3 leave; row 4 moves into hole 0
    assert order == [4, 1, 2]
    assert row_values(slab) == [[5, 51], [2, 20, 21], [3, 3, 31]]
    assert slab.width == 3  # the long rows' columns went


def test_the_window_moves_to_a_new_buffer_when_columns_run_out(monkeypatch):
    monkeypatch.setattr(kvcache, "HEADROOM", 2)
    slab = KVSlab(max_rows=4)
    slab.add(*prefill([1.0], [2]))
    columns = slab.keys[0].shape[2]
    for step in range(3 * columns):
        decode(slab, [float(step)])
    assert row_values(slab) == [[1, 1] + [float(s) for s in range(3 * columns)]]
    assert slab.keys[0].shape[2] >= slab.width


def test_rows_grow_up_to_the_batch_and_an_empty_slab_starts_over():
    slab = KVSlab(max_rows=3)
    for v in (1.0, 2.0, 3.0):
        slab.add(*prefill([v], [2]))
    assert slab.n == 3 and row_values(slab) == [[1, 1], [2, 2], [3, 3]]
    assert slab.keep([]) == [] and slab.n == 0
    slab.add(*prefill([7.0], [4]))
    assert row_values(slab) == [[7] * 4]


def test_a_poisoned_rows_leftovers_never_reach_the_next_occupant():
    slab = KVSlab(max_rows=2)
    slab.add(*prefill([1.0, math.nan], [2, 6]))
    slab.keep([0])
    slab.add(*prefill([3.0], [1]))  # row 1 again, narrower than the window the NaNs filled
    keys, values = slab.window(0)
    assert bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())
    assert row_values(slab) == [[1, 1], [3]]


def test_snapshot_and_reset_rebuild_the_batch_from_parts():
    slab = KVSlab(max_rows=4)
    slab.add(*prefill([1.0, 2.0, 3.0], [1, 2, 3]))
    part = slab.snapshot(torch.tensor([2, 0]))
    mask = slab.mask.index_select(0, torch.tensor([2, 0]))
    slab.reset(part, mask)
    assert row_values(slab) == [[3, 3, 3], [1]]
