"""Linear layers prepared once, by the engine that steps them, for decoding on a CPU:
bfloat16 weights packed in oneDNN's blocked layout where the CPU computes bfloat16, and
float16 weights packed for FBGEMM where it does not. What each is worth, measured, is in
docs/inference.md ("Packed bfloat16 weights", "float16 weights on an AVX2 CPU", "A
float32 vocabulary head, weight first") and docs/benchmarks.md; `python -m bench.decode
--variants ...` measures them again.

`F.linear` on a bfloat16 CPU tensor hands oneDNN a plain row-major weight on every call
(one per linear layer, every decode step), and its products run slower than oneDNN's on a
weight in its own blocked layout. Reordered once at load (`torch.ops.mkldnn`'s
`_reorder_linear_weight`, what inductor's CPU backend does for frozen weights) and run by
`_linear_pointwise`, the same products take less, with the same held-out perplexity.

A packed weight is an opaque oneDNN tensor (no storage torch can share), so the engine
that steps a model packs it, in its own process (`BatchEngine`): an engine process packs
its copy of the pool's shared weights (a packed copy of the linear layers beside them,
counted in the model's `nbytes`), after which the worker gives the pool's row-major copy
of the packed layers back (`engine_process.release_packed`); an engine on the worker's
thread packs the pool's model in place (the row-major weights go, but a tied lm_head's,
which the embedding keeps). Only bfloat16 on a CPU whose oneDNN computes it natively;
float32 steps are not faster packed (the hint is for the few rows of a decode step).

On a CPU without native bfloat16 (AVX2 only, or AVX-512 without BF16, where oneDNN emulates
it: `dtype: auto` is float32 there, and a step of a few rows is bound by reading the
weights), the linear layers keep float16 weights packed for FBGEMM (:class:`HalfLinear`,
`quantized::linear_dynamic_fp16`): half the bytes read, the products in float32; faster at
a few rows, level where a step is bound by arithmetic, perplexity unchanged. Only for
`dtype: auto`: a model asked for in float32 gets float32 weights.

A float32 vocabulary head left unpacked (`dtype: float32`) is computed weight first
(:class:`WeightFirstLinear`): `(W @ xᵀ)ᵀ`, the same weight and the same products, with the
few rows as the product's narrow side, because MKL's `x @ Wᵀ` against a large head ran at
a fraction of its one-row speed for 2-64 rows on some CPUs and not on others. So the
engine times both on the head at load (:func:`weight_first_wins`) and keeps the faster;
the head's weight stays the one parameter it was (tied to the embedding where it is), so
it costs no memory. The other linear layers are small enough that the two orders are level.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from consumers.inference.engine.quantize import QuantLinear

#: The rows oneDNN's reorder is told to expect (a decode step's few; any count runs).
BATCH_HINT = 1
#: How an engine packs a model's linear layers (module docstring).
Packing = Literal["bfloat16", "float16"]
#: Below this many weights a CPU forward pass is Python's time, not the weights'
#: (stories260K: bf16 runs at 0.7x float32 there): `dtype: auto` neither narrows nor packs.
MIN_PARAMS = 10_000_000
#: The rows the head's two orders are timed at, and by how much weight first must win.
WEIGHT_FIRST_ROWS = 8
WEIGHT_FIRST_MARGIN = 1.1
#: A head under this many weights costs too little a step for the timing to matter.
WEIGHT_FIRST_MIN_PARAMS = 4_000_000


def _onednn_bf16() -> bool:
    """Whether this CPU's oneDNN has native bfloat16 kernels (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def supported(model: nn.Module, device: str) -> bool:
    """Whether `model`'s linear layers can run packed: bfloat16 weights on a CPU whose
    oneDNN has native bfloat16 kernels."""
    return device == "cpu" and next(model.parameters()).dtype == torch.bfloat16 and _onednn_bf16()


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16). Elsewhere
    torch emulates it, at about half float32's speed. (oneDNN says it has bfloat16 on
    any AVX-512 CPU, emulating it where the CPU lacks it: `_onednn_bf16` is no guide to
    `dtype: auto`.)"""
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def half_supported(model: nn.Module, device: str) -> bool:
    """Whether `model`'s linear layers can keep float16 weights for float32 products: a
    float32 model on a CPU with FBGEMM (AVX2) that does not multiply bfloat16 natively
    (where it does, `dtype: auto` is bfloat16, packed above)."""
    dtype = next(model.parameters()).dtype
    return (
        device == "cpu"
        and dtype == torch.float32
        and "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch.ops.quantized, "linear_prepack_fp16")
        and not cpu_bf16_native()
    )


def wanted(spec: Any, model: nn.Module) -> Packing | None:
    """How the engine stepping `spec`'s `model` packs its linear layers, or None: asked
    (`prepack`, the default), and `supported` (bfloat16; a quantized model's layers keep
    their kernels for a few rows and pack the float weights of their larger steps) or, for
    an unquantized `dtype: auto` settled on float32 with enough weights to be the cost,
    `half_supported` (float16 weights; an explicit float32 stays float32)."""
    if not spec.prepack:
        return None
    if supported(model, spec.device):
        return "bfloat16"  # a quantized model's float path too (its larger steps)
    if spec.quantize:
        return None
    if spec.dtype == "auto" and parameter_count(model) >= MIN_PARAMS and half_supported(model, spec.device):
        return "float16"
    return None


#: FBGEMM packs a float16 weight in blocks of this many inputs, the last one padded: a
#: 576-input layer (SmolLM2's hidden size) takes 1,024 inputs' room, 1.78x its float16
#: bytes (measured: its lm_head 96 MB packed for 54 MB of float16, 30 of its 1536 x 576
#: projections 90 MB for 51).
FBGEMM_FP16_BLOCK = 512


def packed_nbytes(model: nn.Module, packing: Packing = "bfloat16") -> int:
    """The bytes a packed copy of `model`'s linear layers takes (the packing engine's)."""
    layers = [layer for _, _, layer, _ in packed_linears(model)]
    if packing == "float16":
        block = FBGEMM_FP16_BLOCK
        return sum(2 * m.out_features * -(-m.in_features // block) * block for m in layers)
    return sum(m.weight.nbytes for m in layers)


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight is kept in oneDNN's blocked layout (`packed`)."""

    packed: torch.Tensor

    def __init__(self, linear: nn.Linear, tied: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tied = tied  # a copy of a weight the model keeps elsewhere (an lm_head tied to the embedding)
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), BATCH_HINT)
        self.register_buffer("packed", packed)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class HalfLinear(nn.Module):
    """An `nn.Linear` whose weight (and bias) FBGEMM keeps in float16, packed; float32 in
    and out, the products summed in float32 (`quantized::linear_dynamic_fp16`)."""

    def __init__(self, linear: nn.Linear, tied: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tied = tied
        bias = None if linear.bias is None else linear.bias.detach()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach(), bias)
        self.has_bias = bias is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, float16"


def packed_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear | QuantLinear, bool]]:
    """The layers :func:`prepack_model` packs, as (parent, name, layer, tied): each plain
    `nn.Linear`, replaced by its packed copy (``parent.name``), and each `QuantLinear`,
    whose packed copy becomes its float path (``layer.float_path``: parent is the layer);
    tied where another module keeps its weight (an lm_head tied to the embedding), so the
    row-major weight stays in use after packing."""
    layers = (nn.Linear, QuantLinear)
    kept = {id(p) for module in model.modules() if type(module) not in layers for p in module.parameters(False)}
    found: list[tuple[nn.Module, str, nn.Linear | QuantLinear, bool]] = []
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                found.append((module, name, child, id(child.weight) in kept))
            elif isinstance(child, QuantLinear):
                found.append((child, "float_path", child, id(child.weight) in kept))
    return found


def pack_layers(model: nn.Module, packing: Packing = "bfloat16") -> list[tuple[nn.Module, str, nn.Module]]:
    """A :class:`PackedLinear` (bfloat16) or :class:`HalfLinear` (float16) for every layer
    :func:`packed_linears` names, as (parent, name, new layer), not put in place yet
    (:func:`install`): the model steps on meanwhile, its weights only read."""
    linears = packed_linears(model)
    layer = HalfLinear if packing == "float16" else PackedLinear
    # The packing ops release the GIL: in threads, a start waits for it on every core
    # (SmolLM2 in float16: ~3 s on one core of an AVX2 EPYC, FBGEMM's packing ~30 ns a weight).
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        packed = list(pool.map(lambda item: layer(item[2], tied=item[3]), linears))
    return [(module, name, new) for (module, name, _, _), new in zip(linears, packed, strict=True)]


def install(layers: list[tuple[nn.Module, str, nn.Module]]) -> int:
    """Put :func:`pack_layers`'s layers in place (between two steps); how many."""
    for module, name, new in layers:
        setattr(module, name, new)
    return len(layers)


def prepack_model(model: nn.Module, packing: Packing = "bfloat16") -> int:
    """Pack every layer :func:`packed_linears` names, in place (a plain `nn.Linear`
    replaced, a `QuantLinear`'s float path set); how many."""
    return install(pack_layers(model, packing))


class WeightFirstLinear(nn.Module):
    """An `nn.Linear` computed as `(W @ xᵀ)ᵀ` when more than one row comes (one row:
    `F.linear`, a matrix-vector product either way). Holds the same weight parameter."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        out = (self.weight @ flat.t()).t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def weight_first_wins(linear: nn.Linear, rows: int = WEIGHT_FIRST_ROWS, repeats: int = 3) -> bool:
    """Whether `(W @ xᵀ)ᵀ` beats `F.linear` on `linear` at `rows` rows on this CPU by
    WEIGHT_FIRST_MARGIN (best of `repeats` each, interleaved; ~0.2 s for SmolLM2's head)."""
    x = torch.randn(rows, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
    weight_first = WeightFirstLinear(linear)
    plain = first = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            F.linear(x, linear.weight, linear.bias)
            plain = min(plain, time.perf_counter() - t0)
            t0 = time.perf_counter()
            weight_first(x)
            first = min(first, time.perf_counter() - t0)
    return first * WEIGHT_FIRST_MARGIN < plain


def weight_first_head(model: nn.Module, device: str) -> str | None:
    """Compute `model`'s float32 vocabulary head weight first where that measures faster
    on this CPU (module docstring); what was found, for the log, or None where it does
    not apply (another dtype or device, a head that is not a plain `nn.Linear`, a small one)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if device != "cpu" or type(head) is not nn.Linear or head.weight.dtype != torch.float32:
        return None
    if head.weight.numel() < WEIGHT_FIRST_MIN_PARAMS:
        return None
    if not weight_first_wins(head):
        return "vocabulary head: F.linear kept (weight first measured no faster)"
    model.set_output_embeddings(WeightFirstLinear(head))  # type: ignore[operator]  # a transformers model's
    return f"vocabulary head ({head.out_features} x {head.in_features}) computed weight first"


def parameter_count(model: nn.Module) -> int:
    """The model's weights, packed layers' included (they are not parameters)."""
    packed = sum(m.packed.numel() for m in model.modules() if isinstance(m, PackedLinear) and not m.tied)
    half = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, HalfLinear) and not m.tied)
    return packed + half + sum(p.numel() for p in model.parameters())
