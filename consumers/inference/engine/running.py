"""The batch engine's running batch: its rows (one :class:`Seq` per request, in the KV
slab's row order) and the forward passes that step them: the batch's decode step (the
lean one where it serves), newcomers' padded prefill, both in one packed pass, a prefill
over a prefix cache hit; rows joining and leaving the slab; finished rows' keys and values
kept in the prefix cache.

Poison isolation. A forward pass that raises is re-run on halves of its rows, down to
single rows (:func:`isolating`), so only the rows that fail on their own end with
"error"; the others keep the results of the parts that ran.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from consumers.inference.engine import lean as lean_decode
from consumers.inference.engine import packed
from consumers.inference.engine.kvcache import KV, KVSlab
from consumers.inference.engine.prefix import Hit, PrefixCache
from consumers.inference.engine.sequences import Sampler, Seq
from consumers.inference.engine_io import GenRequest, StepOutput
from consumers.inference.model_loading import LoadedModel

log = logging.getLogger(__name__)
R = TypeVar("R")


class RunningBatch:
    """The rows a :class:`~consumers.inference.engine.batch.BatchEngine` steps, on its
    stepping thread. ``lean``: the whole batch's decode steps skip transformers' forward
    (lean.py); the engine decides it, and a failing lean step turns it off."""

    def __init__(self, loaded: LoadedModel, sampler: Sampler, prefix: PrefixCache | None, max_batch_size: int) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = next(self.model.parameters()).device
        self.sampler = sampler
        self.prefix = prefix
        self.max_batch_size = max_batch_size
        pad = loaded.tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else (loaded.eos_ids[0] if loaded.eos_ids else 0)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5.x renames past_key_values to cache (the old name is deprecated).
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keeps_last = "logits_to_keep" in params
        self.lean = False
        self.seqs: list[Seq] = []  # the running batch, in the KV cache's row order
        self.kv = KVSlab(max_batch_size)
        self.hits: dict[str, Hit] = {}  # admitted requests' prefix hits, until their prefill

    def look_up(self, reqs: list[GenRequest]) -> None:
        """Admitted requests' prefix cache hits, kept until their prefill."""
        if self.prefix is None:
            return
        for req in reqs:
            fresh = not req.resume_ids and req.cache  # one taken over prefills cold
            if fresh and (hit := self.prefix.lookup(req.input_ids)) is not None:
                self.hits[req.request_id] = hit

    def reset(self) -> dict[str, Seq]:
        """Empty the batch after a failed step (what it stored in the prefix cache is not
        trusted either); the rows it ran, by request."""
        running = {s.req.request_id: s for s in self.seqs}
        self.seqs, self.kv = [], KVSlab(self.max_batch_size)
        self.hits.clear()
        if self.prefix is not None:
            self.prefix.clear()
        return running

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache) -> torch.Tensor:
        kwargs = {self._cache_kw: cache, "use_cache": True}
        if self.keeps_last:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kwargs)
        return out.logits[:, -1, :]

    def _lean_step(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Cache) -> torch.Tensor:
        """The batch's decode step by lean.py; where that raises, by transformers' forward
        (which rewrites the slab's new column whole), and, where that one passes, every
        later step too: the lean step was at fault, not a row."""
        try:
            return lean_decode.decode_step(self.model, ids, mask, pos, self.kv)
        except Exception:
            log.exception(
                "%s: the lean decode step failed; running it through transformers' forward", self.loaded.spec.name
            )
        logits = self.forward(ids, mask, pos, cache)
        self.lean = False
        log.error(
            "%s: transformers' forward ran the step the lean one failed: lean decoding is off", self.loaded.spec.name
        )
        return logits

    def decode(self) -> list[StepOutput]:
        seqs = self.seqs
        dev = self.device
        ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=dev)
        pos = torch.tensor([[s.next_pos] for s in seqs], device=dev)
        kv = self.kv
        cache, mask = kv.step_inputs()

        def run(rows: list[int]) -> tuple[torch.Tensor, DynamicCache | None]:
            if len(rows) == len(seqs):  # the whole batch, in place: the usual path
                if self.lean:
                    return self._lean_step(ids, mask, pos, cache), None
                return self.forward(ids, mask, pos, cache), None
            # A part of the batch, on copies of its rows (a failed forward may have
            # written some layers' new column of the slab; the window is intact).
            idx = torch.tensor(rows, device=dev)
            part = DynamicCache(kv.snapshot(idx))
            return self.forward(ids[idx], mask[idx], pos[idx], part), part

        parts, failed = isolating(list(range(len(seqs))), run, "decode step")
        outputs = [seqs[i].output([], "", "error") for i in failed]
        if len(parts) != 1 or failed:  # it ran in parts: the parts' caches become the batch
            rows = [i for part_rows, _ in parts for i in part_rows]
            self.seqs = [seqs[i] for i in rows]
            if not rows:
                kv.reset()
                return outputs
            part_mask = mask.index_select(0, torch.tensor(rows, device=mask.device))
            caches = [c for _, (_, c) in parts if c is not None]
            kv.reset([_cat_layer(n, caches) for n in range(len(kv.keys))], part_mask)
        else:
            kv.commit()
        for s in self.seqs:
            s.next_pos += 1
        logits = parts[0][1][0] if len(parts) == 1 else torch.cat([logits for _, (logits, _) in parts])
        more, alive = self.sampler.advance(self.seqs, logits)
        if len(alive) < len(self.seqs):
            self._remember(self.seqs, more)
            self.keep_rows(alive)
        return outputs + more

    def _newcomers(self, reqs: list[GenRequest]) -> tuple[list[Seq], list[StepOutput]]:
        """Sequences for admitted requests, less those a resume already ended (their outputs)."""
        seqs = [self.sampler.new_seq(r, self.hits.pop(r.request_id, None)) for r in reqs]
        done = [seq.output([], "", reason) for seq in seqs if (reason := self.sampler.already_done(seq))]
        if done:
            ended = {out.request_id for out in done}
            seqs = [seq for seq in seqs if seq.req.request_id not in ended]
        return seqs, done

    def decode_and_prefill(self, reqs: list[GenRequest]) -> list[StepOutput]:
        """The running rows' decode step and the newcomers' prefill in one packed pass
        (packed.py); apart, as two passes that isolate a failing row, if it fails."""
        seqs, outputs = self._newcomers(reqs)
        if not seqs:
            return outputs + self.decode()
        try:
            logits, layout = self._packed_forward(seqs)
        except Exception:
            log.exception("packed step failed (%d + %d rows); decoding and prefilling apart", len(self.seqs), len(seqs))
            hits = [seq for seq in seqs if seq.prefix is not None]
            cold = [seq for seq in seqs if seq.prefix is None]
            return outputs + self.decode() + self.prefill([seq.req for seq in cold]) + self._prefill_hits(hits)
        for seq in seqs:
            seq.prefix = None  # a hit's entry's tensors are not this request's to hold
        running = self.seqs
        n = len(running)
        self.kv.commit()
        for s in running:
            s.next_pos += 1
        more, alive = self.sampler.advance(running, logits[:n])
        outputs += more
        if len(alive) < n:
            self._remember(running, more)
            self.keep_rows(alive)
        more, alive = self.sampler.advance(seqs, logits[n:])
        outputs += more
        if alive:
            self._join(seqs, layout, alive)
        return outputs

    def _packed_forward(self, seqs: list[Seq]) -> tuple[torch.Tensor, packed.Layout]:
        running, dev = self.seqs, self.device
        _, mask = self.kv.step_inputs()
        tokens = [s.tokens[-1] for s in running]
        pos = [s.next_pos for s in running]
        lengths: list[int] = []
        prefixes: list[list[KV] | None] = []
        for seq in seqs:
            ids, hit = seq.req.input_ids, seq.prefix
            # A prefix cache hit rides along too: its tokens after the cached ones, which
            # attend over the cached keys and values (packed.arena_attention).
            cached = hit.tokens if hit is not None else 0
            tokens += ids[cached:]
            pos += range(cached, len(ids))
            lengths.append(len(ids) - cached)
            prefixes.append([(k[:, :, :cached], v[:, :, :cached]) for k, v in hit.value] if hit is not None else None)
        ends = torch.tensor(lengths, device=dev).cumsum(0) + len(running) - 1
        keep = torch.cat([torch.arange(len(running), device=dev), ends])
        layout = packed.Layout(self.kv, mask.bool()[:, None, None, :], lengths, prefixes)
        out = self.model(
            input_ids=torch.tensor([tokens], device=dev),
            position_ids=torch.tensor([pos], device=dev),
            use_cache=False,
            logits_to_keep=keep,
            arena_layout=layout,
        )
        return out.logits[0], layout

    def _join(self, seqs: list[Seq], layout: packed.Layout, alive: list[int]) -> None:
        """Newcomers of a packed step (``alive`` of ``seqs``) join the running batch with
        their prompts' keys and values, left-padded to the longest, as a prefill's are."""
        whole = [layout.cached(i) + length for i, length in enumerate(layout.lengths)]
        mask = _left_padded(whole).to(self.device)
        width = mask.shape[1]
        layers = []
        for kept in layout.prompts:
            k0, v0 = kept[0]
            keys = k0.new_zeros((len(seqs), k0.shape[1], width, k0.shape[3]))
            values = v0.new_zeros((len(seqs), v0.shape[1], width, v0.shape[3]))
            for row, ((k, v), length) in enumerate(zip(kept, whole, strict=True)):
                keys[row, :, width - length :] = k[0]
                values[row, :, width - length :] = v[0]
            layers.append((keys, values))
        self._merge([seqs[i] for i in alive], layers, mask, alive)

    def prefill(self, reqs: list[GenRequest]) -> list[StepOutput]:
        seqs, done_outputs = self._newcomers(reqs)
        hits = [seq for seq in seqs if seq.prefix is not None]
        seqs = [seq for seq in seqs if seq.prefix is None]
        done_outputs += self._prefill_hits(hits)
        reqs = [seq.req for seq in seqs]
        if not seqs:
            return done_outputs
        parts, failed = isolating(
            list(range(len(seqs))), lambda rows: self._prefill_rows([reqs[i] for i in rows]), "prefill"
        )
        outputs = done_outputs + [seqs[i].output([], "", "error") for i in failed]
        for rows, (logits, cache, mask) in parts:
            part = [seqs[i] for i in rows]
            more, alive = self.sampler.advance(part, logits)
            outputs += more
            if alive:
                layers = [(layer.keys, layer.values) for layer in _layers(cache)]
                self._merge([part[i] for i in alive], layers, mask, alive)
        return outputs

    def _prefill_rows(self, reqs: list[GenRequest]) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """One padded forward pass over ``reqs``' prompts (and resumed tokens): last
        logits, new cache, mask."""
        mask = _left_padded([len(r.input_ids) for r in reqs])
        ids = torch.full(mask.shape, self._pad_id, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, mask.shape[1] - len(r.input_ids) :] = torch.tensor(r.input_ids)
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        return self.forward(ids, mask, pos, cache), cache, mask

    def _prefill_hits(self, seqs: list[Seq]) -> list[StepOutput]:
        """Each request with a prefix hit: its prompt's new tokens in a pass over its
        cached keys and values (batch 1; a failure ends only that request)."""
        outputs = []
        for seq in seqs:
            try:
                logits, layers, mask = self._extend(seq)
            except Exception:
                log.exception("prefill over a cached prefix failed; ending the request with an error")
                outputs.append(seq.output([], "", "error"))
                continue
            more, alive = self.sampler.advance([seq], logits)
            outputs += more
            if alive:
                self._merge([seq], layers, mask, alive)
        return outputs

    def _extend(self, seq: Seq) -> tuple[torch.Tensor, list[KV], torch.Tensor]:
        """Last logits, keys and values, and mask of ``seq``'s input after its cached prefix."""
        assert seq.prefix is not None
        ids, reused, dev = seq.req.input_ids, seq.prefix.tokens, self.device
        cache = DynamicCache([(k[:, :, :reused], v[:, :, :reused]) for k, v in seq.prefix.value])
        mask = torch.ones((1, len(ids)), dtype=torch.long, device=dev)
        pos = torch.arange(reused, len(ids), device=dev)[None]
        logits = self.forward(torch.tensor([ids[reused:]], device=dev), mask, pos, cache)
        seq.prefix = None  # the entry's tensors are not this request's to hold
        return logits, [(layer.keys, layer.values) for layer in _layers(cache)], mask

    def _remember(self, seqs: list[Seq], outputs: list[StepOutput]) -> None:
        """Store the keys and values of the running rows that just ended (``outputs`` are
        the rows', in order) in the prefix cache: the tokens fed, every one but the last."""
        if self.prefix is None:
            return
        for row, (seq, out) in enumerate(zip(seqs, outputs, strict=True)):
            if out.finish_reason in ("stop", "length") and seq.req.cache:
                ids = seq.req.prompt_ids + seq.tokens[:-1]  # tokens holds the resumed ones too
                layers = self.kv.row(row, len(ids))
                if layers is not None:
                    self.prefix.store(ids, layers, sum(k.nbytes + v.nbytes for k, v in layers))

    def _merge(self, seqs: list[Seq], layers: list[KV], mask: torch.Tensor, rows: list[int]) -> None:
        """Newcomers (rows ``rows`` of their prefill's keys and values) join the running batch."""
        if len(rows) < mask.shape[0]:
            idx = torch.tensor(rows, device=mask.device)
            layers = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in layers]
            mask = mask.index_select(0, idx)
        self.kv.add(layers, mask)
        self.seqs = self.seqs + seqs

    def keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self.seqs = []
            self.kv.reset()
            return
        self.seqs = [self.seqs[i] for i in self.kv.keep(rows)]


def _left_padded(lengths: list[int]) -> torch.Tensor:
    """The mask of rows of these lengths, right-aligned to the longest: ``[rows, longest]``."""
    width = max(lengths)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return mask


def isolating(rows: list[int], run: Callable[[list[int]], R], what: str) -> tuple[list[tuple[list[int], R]], list[int]]:
    """``run(rows)``; if it raises, the same for each half in turn, down to single rows.

    Returns the parts that ran, in row order, with their results, and the rows that
    failed on their own. Nothing extra when nothing fails; one poison row among n costs
    about 2·log2(n) more (smaller) runs. A failure that is no row's fault (the device)
    ends every row, after 2n - 1 runs.
    """
    try:
        return [(rows, run(rows))], []
    except Exception:
        if len(rows) == 1:
            log.exception("%s failed for a request on its own; ending it with an error", what)
            return [], rows
        log.exception("%s of %d requests failed; running them in halves to isolate the cause", what, len(rows))
    mid = len(rows) // 2
    left, right = isolating(rows[:mid], run, what), isolating(rows[mid:], run, what)
    return left[0] + right[0], left[1] + right[1]


def _cat_layer(n: int, caches: list[DynamicCache]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``n``'s keys and values of ``caches`` stacked along the batch."""
    return torch.cat([_layers(c)[n].keys for c in caches]), torch.cat([_layers(c)[n].values for c in caches])


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers; every layer here has `keys` and `values` (None until first used)."""
    return list(cache.layers)
