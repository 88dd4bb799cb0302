"""Weight-only quantization of a model's linear layers, for decoding on a CPU.

A decode step at a few rows is bound by reading the weights: SmolLM2-135M reads ~270 MB
of bfloat16 a token. Its linear layers (the tied lm_head included, the largest matrix)
are quantized once at load, to

- ``int8``: one int8 per weight, one scale per output channel (symmetric), run by
  ``aten._weight_int8pack_mm``: half the bytes of bfloat16;
- ``int4``: 4 bits per weight in groups of 32 inputs, a scale and a zero point per group
  (asymmetric), run by ``aten._weight_int4pack_mm_for_cpu``: a quarter; the lm_head
  stays int8 (:func:`quantize_model`). A GGUF's Q4_1 weights (groups of 32, a scale and
  a minimum) sit on this grid already, so the SmolLM2 conversion loses nothing more
  there, where int8's one scale per channel moves them off it (perplexity 27.43 with
  int8 layers against 27.18 with int4 ones).

The kernels only pay for few rows: they multiply row by row, where a float GEMM reuses
each weight it reads for every row (bfloat16 at 32 rows is 3-5x faster than them). So
each layer keeps both: the packed weights for a step of up to ``max_rows`` rows, and
the float weights *dequantized from them* for larger steps (in bfloat16 on a CPU that
computes it natively, packed for oneDNN by the engine as an unquantized model's are:
prepack.py). Both paths compute with
the same weights, so a request's tokens do not depend on how many others share its
step (to rounding). The cost is the packed copy beside the float one (+50% for int8,
+25% for int4), which :func:`~consumers.inference.model_loading.load_model` counts.

The kernels run in bfloat16 (their float32 paths are not vectorized: 10x slower), on
the step's activations cast to it and back.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Quantize = Literal["int8", "int4"]
#: Inputs per int4 group (a GGUF Q4_1 block).
GROUP = 32
#: Rows a step may have for the quantized kernels to run it (measured on SmolLM2-135M,
#: bench.decode: both kernels beat bfloat16 at 1 row and lose from 8).
MAX_ROWS = 4
_KERNEL_DTYPE = torch.bfloat16


class QuantLinear(nn.Module):
    """A linear layer with packed weight-only quantized weights for steps of up to
    ``max_rows`` rows, and their dequantized float copy (``weight``) for larger ones."""

    def __init__(self, linear: nn.Linear, kind: Quantize, max_rows: int = MAX_ROWS) -> None:
        super().__init__()
        if fitting(linear, kind) != kind:
            raise ValueError(f"{kind} does not take this layer's shape: {linear}")
        self.kind, self.max_rows = kind, max_rows
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        packed, scales, dequantized = _int8(w) if kind == "int8" else _int4(w)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales.to(_KERNEL_DTYPE))
        self.weight = nn.Parameter(dequantized.to(linear.weight.dtype), requires_grad=False)
        self.bias = linear.bias
        #: What steps of more rows run instead of ``weight`` row-major, once the engine
        #: has packed a copy of it (prepack.py: a PackedLinear over the same weights).
        self.float_path: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows or x.device.type != "cpu":
            if self.float_path is not None:
                return self.float_path(x)
            return F.linear(x, self.weight, self.bias)
        # A step calls this ~200 times: no call for a cast or a copy that is not needed.
        flat = x.reshape(rows, self.in_features)
        if flat.dtype != _KERNEL_DTYPE:
            flat = flat.to(_KERNEL_DTYPE)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if flat.data_ptr() % 64:  # the int8 kernel crashes on a view that starts unaligned (torch 2.13)
            flat = flat.clone()
        scales = self.scales
        if scales.dtype != _KERNEL_DTYPE:  # a float32 model's .to() widened them (exactly)
            scales = scales.to(_KERNEL_DTYPE)
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(flat, self.packed, scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, scales)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind}, max_rows={self.max_rows}"


def fitting(linear: nn.Linear, kind: Quantize) -> Quantize | None:
    """``kind``, or the nearest kind whose kernel takes this layer's shape, or None (float).

    int4 packs groups of GROUP inputs and 16 outputs; the int8 kernel reads past the end
    of a row whose length is not a multiple of 16 when it has more than one row (a
    segmentation fault, torch 2.13)."""
    if kind == "int4" and linear.in_features % GROUP == 0 and linear.out_features % 16 == 0:
        return "int4"
    return "int8" if linear.in_features % 16 == 0 else None


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: packed ``[out, in]``, scales ``[out]``, dequantized."""
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    scale = scale.to(_KERNEL_DTYPE).float()  # the kernel's scales: dequantize with exactly those
    q = torch.round(w / scale[:, None]).clamp(-127, 127)
    return q.to(torch.int8), scale, q * scale[:, None]


def _int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 in groups of GROUP inputs: packed, ``[in/GROUP, out, 2]`` scales and
    zeros (the kernel's ``(q - 8) * scale + zero``), dequantized."""
    out, inp = w.shape
    g = w.reshape(out, inp // GROUP, GROUP)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(_KERNEL_DTYPE).float()
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    zero = (lo + 8 * scale).to(_KERNEL_DTYPE).float()
    dequantized = ((q - 8) * scale[..., None] + zero[..., None]).reshape(out, inp)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(out, inp).to(torch.int32), 1)
    return packed, torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous(), dequantized


def quantize_model(model: nn.Module, kind: Quantize, max_rows: int = MAX_ROWS) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`QuantLinear`; returns how many.

    The output layer (lm_head) is int8 under ``int4`` too, as llama.cpp's 4-bit files keep
    theirs at 6-8 bits: SmolLM2-135M's held-out perplexity is 27.19 in float32, 27.15 with
    int4 layers and an int8 lm_head, 27.88 with an int4 lm_head. A layer whose shape the
    kernel does not take gets the next that does (:func:`fitting`: int4, int8, or left in
    float). A tied input embedding (the lm_head's weight) takes the dequantized weights too, so
    the tie holds and the embedding lookup sees the same weights as the lm_head."""
    inputs, outputs = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = inputs() if inputs is not None else None
    tied = embedding.weight if embedding is not None else None
    head = outputs() if outputs is not None else None
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not isinstance(child, QuantLinear):
                fits = fitting(child, "int8" if child is head else kind)
                if fits is None:
                    continue
                quant = QuantLinear(child, fits, max_rows)
                if tied is not None and child.weight is tied:
                    embedding.weight = quant.weight  # type: ignore[union-attr]
                setattr(parent, name, quant)
                count += 1
    return count
