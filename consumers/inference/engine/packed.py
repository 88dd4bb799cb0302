"""One forward pass for a step that both decodes the running batch and prefills newcomers.

Without it a step with newcomers runs two passes: the running rows' decode (one token
each) and the newcomers' padded prefill. On a model whose forward pass is bound by
reading its weights (a small model on a CPU: one token, 16 rows or a 30-token prompt take
about as long as each other), the two passes cost about as much as one pass over all
their tokens would cost plus a second sweep of the weights. Packed, every new token of
the step goes through the layers once, as one sequence ``[1, T]``:

    [ row 0's token | row 1's token | ... | newcomer A's prompt | newcomer B's prompt ]

The linear layers do not care which request a token belongs to; attention does. It is
an attention function registered with transformers (``ARENA_ATTENTION``) that, when
the call carries a :class:`Layout`, writes the running rows' keys and values into the
KV slab's next column and attends each of them over its own row of the slab (as a
decode step does), and attends each newcomer's tokens causally over its own prompt only
(as its prefill does), keeping those keys and values for the newcomer to join the slab
afterwards. A newcomer whose prompt starts with a prefix cache hit brings only the tokens
after it; they attend over the hit's cached keys and values first (a causal mask offset
by the cached length), and the newcomer joins the slab with both. Without a layout the
function is transformers' own SDPA attention, and the model's masks are built as SDPA's,
so every other call is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from consumers.inference.engine import prepack
from consumers.inference.engine.kvcache import KVSlab

ARENA_ATTENTION = "arena_sdpa"


@dataclass
class Layout:
    """Where each request's tokens sit in a packed step (see the module docstring)."""

    slab: KVSlab  # the running rows: one token each, first in the sequence, in row order
    mask: torch.Tensor  # what they attend to: the slab's window and the new column, [n, 1, 1, width + 1], bool
    lengths: list[int]  # then each newcomer's token count, in order
    #: Each newcomer's cached prefix (a prefix cache hit: each layer's keys and values of
    #: its first tokens, [1, heads, cached, dim]; its ``lengths`` entry counts the rest),
    #: or None; empty: none has one (a layout built without them).
    prefixes: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = field(default_factory=list)
    #: Filled by the pass: each layer's keys and values of each newcomer, [1, heads, length, dim]
    #: (its cached prefix's first, where it has one).
    prompts: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)

    def cached(self, newcomer: int) -> int:
        """How many of a newcomer's tokens its cached prefix holds (0: none)."""
        prefix = self.prefixes[newcomer] if self.prefixes else None
        return 0 if prefix is None else prefix[0][0].shape[2]


def one_query_attention(query, keys, values, mask, scale):
    """Each row's one query ``[rows, heads, 1, dim]`` over its keys and values ``[rows,
    kv_heads, columns, dim]`` (a decode step). Where heads share a key/value head (GQA),
    each group of query heads attends as that head's queries ``[rows, kv_heads, group,
    dim]``, which a mask of one head ``[rows, 1, 1, columns]`` covers alike: SDPA's own
    ``enable_gqa`` kernel is several times slower for one query on a CPU (docs/inference.md,
    A decode step's attention; `python -m bench.attention`). What transformers does where a mask is
    given (``pack_gqa``), for every one-query call."""
    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale).reshape(rows, heads, 1, dim)


def arena_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    layout: Layout | None = kwargs.pop("arena_layout", None)
    if layout is None:
        one_head_mask = attention_mask is None or attention_mask.shape[1] == 1
        if query.shape[2] == 1 and one_head_mask and kwargs.get("position_bias") is None:
            return one_query_attention(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    gqa = query.shape[1] != key.shape[1]
    slab, n = layout.slab, layout.slab.n
    parts = []
    if n:
        # The running rows: [1, heads, n, dim] -> [n, heads, 1, dim], one column each.
        q = query[0, :, :n].transpose(0, 1).unsqueeze(2)
        kb, vb = slab.keys[module.layer_idx], slab.values[module.layer_idx]
        kb[:n, :, slab.end] = key[0, :, :n].transpose(0, 1)
        vb[:n, :, slab.end] = value[0, :, :n].transpose(0, 1)
        keys, values = kb[:n, :, slab.start : slab.end + 1], vb[:n, :, slab.start : slab.end + 1]
        out = one_query_attention(q, keys, values, layout.mask, scaling)
        parts.append(out.squeeze(2).transpose(0, 1).unsqueeze(0))  # back to [1, heads, n, dim]
    kept = []
    offset = n
    for newcomer, length in enumerate(layout.lengths):
        span = slice(offset, offset + length)
        k, v = key[:, :, span], value[:, :, span]
        cached = layout.cached(newcomer)
        if cached:  # its new tokens attend over its cached prefix, then causally over themselves
            prefix_k, prefix_v = layout.prefixes[newcomer][module.layer_idx]  # type: ignore[index]
            k, v = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)
            causal = torch.ones(length, cached + length, dtype=torch.bool, device=k.device).tril(cached)
            out = F.scaled_dot_product_attention(
                query[:, :, span], k, v, attn_mask=causal, scale=scaling, enable_gqa=gqa
            )
        else:
            out = F.scaled_dot_product_attention(query[:, :, span], k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        kept.append((k, v))
        parts.append(out)
        offset += length
    layout.prompts.append(kept)
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


#: Parameters from which a model packs by default. Below it a forward pass on a CPU is
#: Python's time, not the weights': a tiny model made no more tokens packed (the attention
#: function's Python per layer, beside the event loop's thread, costs what the second
#: pass saved), while a 60M model's steps with newcomers took about a third less
#: (docs/benchmarks.md, A step with newcomers).
PACK_MIN_PARAMS = 10_000_000


def worth_packing(model) -> bool:
    return prepack.parameter_count(model) >= PACK_MIN_PARAMS


def register() -> None:
    """Make ``ARENA_ATTENTION`` a name transformers knows, for attention and its masks."""
    AttentionInterface.register(ARENA_ATTENTION, arena_attention)
    AttentionMaskInterface.register(ARENA_ATTENTION, sdpa_mask)


def enable(model) -> bool:
    """Switch a model that attends with SDPA to ``ARENA_ATTENTION`` (SDPA itself unless a
    call carries a layout); False when it attends otherwise and packing is not used."""
    config = model.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", ARENA_ATTENTION):
        return False
    if config.model_type not in PACKABLE:
        return False
    register()
    for sub in model.modules():  # submodules may hold their own config object
        own = getattr(sub, "config", None)
        if own is not None and getattr(own, "_attn_implementation", None) == "sdpa":
            own._attn_implementation = ARENA_ATTENTION
    return True


def disable(model) -> None:
    """Back to transformers' own SDPA (what ``enable`` switched), for code that runs the
    model through transformers' other paths (its continuous batching refuses others)."""
    for sub in model.modules():
        own = getattr(sub, "config", None)
        if own is not None and getattr(own, "_attn_implementation", None) == ARENA_ATTENTION:
            own._attn_implementation = "sdpa"


#: Models checked to pack exactly (the same tokens as two passes, tests/unit/test_engine.py):
#: full causal attention, rotary positions from ``position_ids``, and the registered
#: attention function called with the new tokens' keys and values. Others (sliding
#: windows, other position schemes) run two passes.
PACKABLE = {"llama"}
