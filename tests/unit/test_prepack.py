"""bfloat16 linear layers packed in oneDNN's layout at load (consumers/inference/prepack.py):
the same products as `F.linear`, every linear layer swapped, a tied lm_head's embedding
kept, the parameter count unchanged. On a CPU without native bfloat16 the model is left
as it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from consumers.inference import prepack
from consumers.inference.engine import BatchEngine
from consumers.inference.models import ModelSpec, load_model
from tests.conftest import STORIES

NATIVE = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_computes_what_the_plain_one_does(rows, bias):
    if not NATIVE:
        assert not prepack.supported(torch.nn.Linear(4, 4).bfloat16(), "cpu")
        return
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=bias).bfloat16()
    x = torch.randn(rows, 7, 576).bfloat16()
    packed = prepack.PackedLinear(linear)
    with torch.inference_mode():
        got, want = packed(x).float(), F.linear(x, linear.weight, linear.bias).float()
    assert got.shape == want.shape == (rows, 7, 1536)
    torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)  # bfloat16 rounding, blocked sums


def test_the_engine_packs_a_bfloat16_model_and_leaves_a_float32_one_as_it_was():
    """`BatchEngine` packs the model it steps (in its own process: the packed weights are
    opaque oneDNN tensors no process can share); the load counts the packed copy."""
    bf16 = load_model(ModelSpec(name="s", path=str(STORIES), dtype="bfloat16"))
    plain = load_model(ModelSpec(name="s", path=str(STORIES), dtype="bfloat16", prepack=False))
    fp32 = load_model(ModelSpec(name="s", path=str(STORIES), dtype="float32"))
    assert bf16.nbytes == plain.nbytes + (prepack.packed_nbytes(plain.model) if NATIVE else 0)
    for loaded in (bf16, plain, fp32):
        BatchEngine(loaded, "continuous")
    assert not any(isinstance(m, prepack.PackedLinear) for m in [*fp32.model.modules(), *plain.model.modules()])
    layers = [m for m in bf16.model.modules() if isinstance(m, (torch.nn.Linear, prepack.PackedLinear))]
    assert layers and all(isinstance(m, prepack.PackedLinear) == NATIVE for m in layers)
    assert prepack.parameter_count(bf16.model) == prepack.parameter_count(plain.model)
    ids = torch.tensor([bf16.tokenizer.encode("Once upon a time there was a little dog")])
    with torch.inference_mode():
        got, want = bf16.model(input_ids=ids).logits.float(), plain.model(input_ids=ids).logits.float()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    torch.testing.assert_close(got, want, atol=0.25, rtol=0.05)
