"""Weight-only quantized linear layers: the kernels' results against a float reference
on the dequantized weights, the dispatch by rows, and a model's layers swapped in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from consumers.inference.engine.quantize import MAX_ROWS, QuantLinear, quantize_model
from consumers.inference.errors import PermanentError
from consumers.inference.model_loading import ModelSpec, load_model, load_models_config

pytestmark = pytest.mark.timeout(120)

STORIES = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K-hf"


def linear(out: int = 96, inp: int = 128, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(inp, out, bias=bias)
    with torch.no_grad():
        layer.weight.mul_(torch.linspace(0.2, 3.0, out)[:, None])  # channels of different ranges
    return layer


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, MAX_ROWS])
def test_the_kernel_matches_a_float_product_with_the_dequantized_weights(kind, rows):
    float_layer = linear(bias=True)
    quant = QuantLinear(float_layer, kind)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    expected = F.linear(x.float(), quant.weight.float(), float_layer.bias.detach())
    got = quant(x.float())
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # bfloat16 inputs, float accumulation: within bfloat16's rounding of the output
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("kind", "bound"), [("int8", 1 / 254), ("int4", 1 / 30)])
def test_dequantized_weights_are_within_half_a_step_of_the_originals(kind, bound):
    float_layer = linear()
    quant = QuantLinear(float_layer, kind)
    w = float_layer.weight.detach()
    err = (quant.weight - w).abs()
    span = w.abs().amax(dim=1, keepdim=True) if kind == "int8" else 2 * w.abs().amax()
    assert (err <= span * bound * 1.05).all()  # half a step, with the bfloat16 rounding of the scale
    assert err.max() > 0  # it was quantized


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_few_rows_take_the_kernel_and_more_rows_the_float_weights(kind):
    quant = QuantLinear(linear(), kind, max_rows=2)
    x = torch.randn(3, 128)
    reference = quant(x).clone()  # 3 rows: the float weights
    with torch.no_grad():
        quant.weight.zero_()  # the float path now gives zeros; the kernel does not read it
    assert quant(x).abs().max() == 0
    few = quant(x[:2])  # 2 rows: the kernel, the float weights' zeros unseen
    torch.testing.assert_close(few, reference[:2], rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        quant.scales.zero_()  # and with its scales (and int4's zeros) gone, the kernel gives zeros
    assert quant(x[:1]).abs().max() == 0
    # a [batch, seq, features] activation: rows are batch x seq
    assert quant(torch.randn(1, 1, 128)).abs().max() == 0
    assert quant(torch.randn(1, 3, 128)).abs().max() == 0  # 3 rows: float weights, also zero now


def test_a_model_keeps_its_tied_embedding_and_each_layer_gets_the_kernel_its_shape_takes():
    model = load_model(ModelSpec(name="s", path=str(STORIES), dtype="float32")).model
    n = sum(isinstance(m, nn.Linear) for m in model.modules())
    layers = model.model.layers
    assert quantize_model(model, "int4") == n - len(layers)  # the down projections (172 inputs) stay float
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    mlp = layers[0].mlp
    assert (mlp.gate_proj.kind, mlp.up_proj.kind) == ("int8", "int8")  # 172 outputs: not int4's multiple of 16
    assert type(mlp.down_proj) is nn.Linear
    assert layers[0].self_attn.q_proj.kind == "int4"
    assert model.lm_head.kind == "int8"  # the output layer keeps 8 bits


def test_a_spec_validates_quantize_and_a_variant_inherits_it(tmp_path):
    assert ModelSpec(name="m", path="/x", quantize="int8").quantize == "int8"
    with pytest.raises(ValueError, match="quantize"):
        ModelSpec(name="m", path="/x", quantize="int3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPU only"):
        ModelSpec(name="m", path="/x", quantize="int8", device="cuda")
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - {name: a, path: /x, quantize: int4}\n  - {name: b, base: a}\n")
    a, b = load_models_config(str(cfg), str(tmp_path))
    assert a.quantize == b.quantize == "int4"
    cfg.write_text("models:\n  - {name: a, path: /x, quantize: fp8}\n")
    with pytest.raises(PermanentError, match="quantize"):
        load_models_config(str(cfg), str(tmp_path))


def test_a_quantized_model_loads_and_counts_both_copies():
    plain = load_model(ModelSpec(name="s", path=str(STORIES), dtype="float32"))
    quant = load_model(ModelSpec(name="s", path=str(STORIES), dtype="float32", quantize="int8"))
    packed = sum(m.packed.numel() for m in quant.model.modules() if isinstance(m, QuantLinear))
    assert quant.nbytes >= plain.nbytes + packed  # int8: one byte a weight, beside the float copy
    ids = torch.tensor([[1, 400, 30, 90]])
    with torch.inference_mode():
        assert quant.model(input_ids=ids).logits.shape == plain.model(input_ids=ids).logits.shape
