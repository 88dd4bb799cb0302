"""bfloat16 linear layers with their weights packed once in oneDNN's blocked layout, for
decoding on a CPU.

`F.linear` on a bfloat16 CPU tensor hands oneDNN a plain row-major weight on every call
(a decode step of SmolLM2-135M makes 211 such calls, one per linear layer), and its
products then ran at about half the speed of oneDNN's on a weight in its own blocked
layout (a micro-benchmark of SmolLM2's shapes at one row: 50 µs against 26 for q/o, 106
against 52 for gate/up, 3.5 ms against 2.1 for the lm_head). Reordered once at load (`torch.ops.mkldnn`'s
`_reorder_linear_weight`, what inductor's CPU backend does for frozen weights) and run by
`_linear_pointwise`, the same products take less: SmolLM2's step alone 37.7 ms against
52.9, at 8 rows 44.9 against 63.2, at 32 rows 70.6 against 83.5 (`python -m bench.decode
--variants fp32,bf16-plain,bf16,int8 --threads 1 --rounds 2 --tokens 16`, this VM's AMX
Xeon), with the same held-out perplexity (27.18 against 27.21).

A packed weight is an opaque oneDNN tensor (no storage torch can share), so the engine
that steps a model packs it, in its own process (`BatchEngine`): an engine process packs
its copy of the pool's shared weights (a packed copy of the linear layers beside them:
+269 MB for SmolLM2, counted in the model's `nbytes`); an engine on the worker's thread
packs the pool's model in place (the row-major weights go, but a tied lm_head's, which
the embedding keeps). Only bfloat16 on a CPU whose oneDNN computes it natively; float32
steps are not faster packed (the hint is for the few rows of a decode step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: The rows oneDNN's reorder is told to expect (a decode step's few; any count runs).
BATCH_HINT = 1


def supported(model: nn.Module, device: str) -> bool:
    """Whether `model`'s linear layers can run packed: bfloat16 weights on a CPU whose
    oneDNN has native bfloat16 kernels (AVX512-BF16 or AMX)."""
    dtype = next(model.parameters()).dtype
    return (
        device == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def wanted(spec: Any, model: nn.Module) -> bool:
    """Whether the engine stepping `spec`'s `model` packs it: asked (`prepack`, the
    default), not quantized (its own kernels), and `supported`."""
    return spec.prepack and not spec.quantize and supported(model, spec.device)


def packed_nbytes(model: nn.Module) -> int:
    """The bytes a packed copy of `model`'s linear layers takes (the packing engine's)."""
    return sum(m.weight.nbytes for m in model.modules() if type(m) is nn.Linear)


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


def prepack_model(model: nn.Module) -> int:
    """Replace every plain `nn.Linear` of `model` by a :class:`PackedLinear`; how many."""
    linears = [
        (module, name, child)
        for module in model.modules()
        for name, child in module.named_children()
        if isinstance(child, nn.Linear) and type(child) is nn.Linear
    ]
    kept = {id(p) for module in model.modules() if type(module) is not nn.Linear for p in module.parameters(False)}
    for module, name, child in linears:
        setattr(module, name, PackedLinear(child, tied=id(child.weight) in kept))
    return len(linears)


def parameter_count(model: nn.Module) -> int:
    """The model's weights, packed layers' included (they are buffers, not parameters)."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and not m.tied]
    packed = sum(m.packed.numel() for m in layers)
    return packed + sum(p.numel() for p in model.parameters())
