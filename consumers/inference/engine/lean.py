"""A decode step of a Llama model without transformers' generic forward.

A decode step runs every layer for one token a row. Through transformers' forward it
also runs what a general model needs and a decode step over the KV slab does not: the
output-capturing and kwargs decorators, the causal mask built from the 2D mask, a
``Cache`` object with a layer object per layer, the attention interface's dispatch, and
``nn.Module.__call__`` around every norm, projection and activation (13 calls a layer).
On a small model that is a tenth of a step or more at one row (docs/inference.md, "A decode
step without transformers' forward"; ``python -m bench.decode --variants bf16,int4 --rows 1,8 --lean both``).

:func:`decode_step` computes the same thing with the same operations in the same order
and the same dtypes, so its logits are bitwise those of the forward it replaces (tests
compare them): RMSNorm in float32 and back, the rotary embedding by the model's own
``rotary_emb`` (scaling types included), keys and values written into the slab's next
column as ``_SlabLayer.update`` writes them, attention by
:func:`~consumers.inference.engine.packed.one_query_attention` as ``arena_attention`` runs it
for one query, the projections by the model's own modules (packed, float16 or
quantized: their ``forward``, without ``__call__``'s hooks).

It serves the steps that decode the whole running batch (the usual step); a step with
newcomers (packed.py), a prefill, and a batch run in parts after a failure go through
transformers' forward as before. Only a model :func:`supported` says is a plain Llama.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llama import modeling_llama as llama

from consumers.inference.engine.kvcache import KVSlab
from consumers.inference.engine.packed import PACKABLE, one_query_attention


def supported(model: Any) -> bool:
    """Whether ``model`` is a Llama that :func:`decode_step` computes as transformers does:
    its model type packable (the arena attention its decode steps run), no sliding window,
    and its layers, their attention, MLP and RMSNorms transformers' own Llama classes (what
    their projections are is the model's: packed, float16 or quantized)."""
    config = model.config
    inner = getattr(model, "model", None)
    if config.model_type not in PACKABLE or inner is None or getattr(config, "sliding_window", None):
        return False
    layers = getattr(inner, "layers", None)
    if not layers or not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm")):
        return False
    return type(inner.norm).forward is llama.LlamaRMSNorm.forward and all(
        _forwards(layer) == _LLAMA_FORWARDS for layer in layers
    )


def decode_step(model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, slab: KVSlab) -> torch.Tensor:
    """Logits ``[n, vocab]`` of one decode step for the slab's ``n`` running rows.

    ``ids`` and ``pos`` are ``[n, 1]``; ``mask`` is the step's ``[n, width + 1]`` mask
    (:meth:`KVSlab.step_inputs`, which made room for the new column); each layer's new key
    and value go into column ``slab.end``, which :meth:`KVSlab.commit` then takes in."""
    inner = model.model
    n = ids.shape[0]
    hidden = inner.embed_tokens.forward(ids)
    cos, sin = inner.rotary_emb(hidden, pos)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    # transformers' mask for one query: none where every column is real, else [n, 1, 1, columns]
    attend = None if bool(mask.all()) else mask[:, None, None, :].bool()
    start, end = slab.start, slab.end
    for index, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        shape = (n, 1, -1, attn.head_dim)
        x = _rms(hidden, layer.input_layernorm)
        q = attn.q_proj.forward(x).view(shape).transpose(1, 2)
        k = attn.k_proj.forward(x).view(shape).transpose(1, 2)
        v = attn.v_proj.forward(x).view(shape).transpose(1, 2)
        q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
        keys, values = slab.keys[index], slab.values[index]
        keys[:n, :, end : end + 1] = k
        values[:n, :, end : end + 1] = v
        out = one_query_attention(q, keys[:n, :, start : end + 1], values[:n, :, start : end + 1], attend, attn.scaling)
        hidden = hidden + attn.o_proj.forward(out.transpose(1, 2).reshape(n, 1, -1))
        x = _rms(hidden, layer.post_attention_layernorm)
        hidden = hidden + mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
    return model.lm_head.forward(_rms(hidden, inner.norm))[:, -1, :]


def _rms(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, back to the input's dtype, then the weight."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q and k."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _forwards(layer: Any) -> tuple:
    parts = (layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
    return tuple(type(part).forward for part in parts)


#: The forwards decode_step stands in for: a decoder layer, its attention, its MLP, its two RMSNorms.
_LLAMA_FORWARDS = (
    llama.LlamaDecoderLayer.forward,
    llama.LlamaAttention.forward,
    llama.LlamaMLP.forward,
    llama.LlamaRMSNorm.forward,
    llama.LlamaRMSNorm.forward,
)
