"""bfloat16 linear layers packed in oneDNN's layout at load (consumers/inference/engine/prepack.py):
the same products as `F.linear`, every linear layer swapped, a tied lm_head's embedding
kept, the parameter count unchanged. On a CPU without native bfloat16 the model is left
as it is. A float32 vocabulary head computed weight first: the same products, the same
parameter, only where the load's timing found it faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from consumers.inference import model_loading
from consumers.inference.engine import prepack
from consumers.inference.engine.batch import BatchEngine
from consumers.inference.engine.quantize import MAX_ROWS, QuantLinear
from consumers.inference.model_loading import ModelSpec, load_model
from consumers.inference.runners import process as engine_process
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


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_weight_first_layer_computes_what_the_plain_one_does(rows, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 4096, bias=bias)
    first = prepack.WeightFirstLinear(linear)
    assert first.weight is linear.weight  # the same parameter: no copy
    for x in (torch.randn(rows, 576), torch.randn(rows, 2, 576)):
        with torch.inference_mode():
            got, want = first(x), F.linear(x, linear.weight, linear.bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # float32, sums in another order


@pytest.mark.parametrize("wins", [True, False])
def test_the_head_is_computed_weight_first_only_where_it_measured_faster(monkeypatch, wins):
    """A float32 head goes weight first when the load's timing says so, keeping its tie to
    the embedding; bfloat16 and quantized heads, and small ones, are left as they are."""
    monkeypatch.setattr(prepack, "WEIGHT_FIRST_MIN_PARAMS", 0)  # stories260K's head is small
    monkeypatch.setattr(prepack, "weight_first_wins", lambda linear: wins)
    loaded = load_model(ModelSpec(name="s", path=str(STORIES), dtype="float32"))
    model = loaded.model
    ids = torch.tensor([loaded.tokenizer.encode("Once upon a time there was a little dog")] * 3)
    with torch.inference_mode():
        want = model(input_ids=ids).logits
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    BatchEngine(loaded, "continuous")
    head = model.get_output_embeddings()
    assert isinstance(head, prepack.WeightFirstLinear) == wins
    assert (head.weight is model.get_input_embeddings().weight) == tied
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-4, rtol=1e-4)
    bf16 = load_model(ModelSpec(name="s", path=str(STORIES), dtype="bfloat16"))
    assert prepack.weight_first_head(bf16.model, "cpu") is None
    assert prepack.weight_first_head(model, "cuda") is None


HALF = prepack.half_supported(torch.nn.Linear(4, 4), "cpu")
FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines  # every x86 CPU with AVX2


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_a_float16_weight_layer_computes_what_the_float32_one_does(rows, bias):
    if not FBGEMM:
        assert not HALF
        return
    torch.manual_seed(0)
    linear = torch.nn.Linear(576, 1536, bias=bias)
    half = prepack.HalfLinear(linear)
    x = torch.randn(rows, 7, 576)
    with torch.inference_mode():
        got, want = half(x), F.linear(x, linear.weight, linear.bias)
        strided = half(torch.randn(rows, 576, 7).transpose(1, 2))  # a view, as HF's last-position slice
    assert got.dtype == torch.float32 and got.shape == want.shape == (rows, 7, 1536)
    assert strided.shape == (rows, 7, 1536)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)  # the weights rounded to float16


def test_dtype_auto_on_a_cpu_without_bfloat16_packs_float16_weights_and_an_explicit_float32_stays(monkeypatch):
    """`dtype: auto` settled on float32 (no native bfloat16) gets float16 weights where the
    model is big enough (stories260K is not: the floor is lowered here); `dtype: float32`
    asked for keeps float32 weights; the load counts the packed copy."""
    monkeypatch.setattr(prepack, "MIN_PARAMS", 0)
    monkeypatch.setattr(model_loading, "BF16_MIN_PARAMS", 0)  # where bfloat16 is native, auto takes it
    auto = load_model(ModelSpec(name="s", path=str(STORIES), dtype="auto"))
    fp32 = load_model(ModelSpec(name="s", path=str(STORIES), dtype="float32"))
    off = load_model(ModelSpec(name="s", path=str(STORIES), dtype="auto", prepack=False))
    ids = torch.tensor([auto.tokenizer.encode("Once upon a time there was a little dog")])
    with torch.inference_mode():
        want = fp32.model(input_ids=ids).logits
    for loaded in (auto, fp32, off):
        BatchEngine(loaded, "continuous")
    if (
        prepack.cpu_bf16_native()
    ):  # auto is bfloat16 here, packed in oneDNN's layout (no float16 copy); float32 stays float32
        assert auto.model.dtype == torch.bfloat16 and fp32.model.dtype == torch.float32
        assert any(isinstance(m, prepack.PackedLinear) for m in auto.model.modules())
        assert not any(isinstance(m, prepack.HalfLinear) for m in auto.model.modules())
        return
    expected = "float16" if HALF else None
    assert prepack.wanted(auto.spec, off.model) == expected
    assert auto.nbytes == off.nbytes + (prepack.packed_nbytes(off.model, "float16") if HALF else 0)
    layers = [m for m in auto.model.modules() if isinstance(m, (torch.nn.Linear, prepack.HalfLinear))]
    assert layers and all(isinstance(m, prepack.HalfLinear) == HALF for m in layers)
    assert not any(isinstance(m, prepack.HalfLinear) for m in [*fp32.model.modules(), *off.model.modules()])
    assert prepack.parameter_count(auto.model) == prepack.parameter_count(off.model)
    with torch.inference_mode():
        got = auto.model(input_ids=ids).logits
    assert (got.argmax(-1) == want.argmax(-1)).all()
    torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)


def test_a_quantized_bfloat16_model_keeps_its_kernels_and_packs_the_float_path_of_larger_steps():
    """int4 layers run their kernel for a few rows; the float weights dequantized from the
    same integers serve larger steps, packed like an unquantized model's (the engine packs
    its copy; the load counts it), and what the worker can give back once they are in
    place is named as the layers' own weights (engine_process.release_packed)."""
    spec = ModelSpec(name="s", path=str(STORIES), dtype="bfloat16", quantize="int4")
    loaded = load_model(spec)
    quants = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert quants and all(m.float_path is None for m in quants)
    assert (prepack.wanted(spec, loaded.model) == "bfloat16") == NATIVE
    plain = load_model(spec.model_copy(update={"prepack": False}))
    assert loaded.nbytes == plain.nbytes + (prepack.packed_nbytes(plain.model) if NATIVE else 0)
    engine_process.share(loaded)  # as a worker does, before an engine packs
    x = torch.randn(MAX_ROWS + 3, quants[0].in_features).bfloat16()
    with torch.inference_mode():
        before = [m(x).float() for m in quants]
    BatchEngine(loaded, "continuous")
    assert all(isinstance(m.float_path, prepack.PackedLinear) == NATIVE for m in quants)
    layers = prepack.packed_linears(loaded.model)
    quantized = [(parent, layer) for parent, _, layer, _ in layers if isinstance(layer, QuantLinear)]
    assert len(quantized) == len(quants) and all(parent is layer for parent, layer in quantized)
    # The layers too small to quantize: replaced by packed copies where bfloat16 is native.
    assert (len(layers) == len(quants)) == NATIVE
    released = engine_process.release_packed(loaded)  # whole pages only: not every small layer
    quant_weights = {f"{n}.weight" for n, m in loaded.model.named_modules() if isinstance(m, QuantLinear)}
    assert set(released) <= quant_weights and (len(released) > 0) == NATIVE
    with torch.inference_mode():  # the row-major float weights given back: not read any more
        for m, want in zip(quants, before, strict=True):
            torch.testing.assert_close(m(x).float(), want, atol=0.02, rtol=0.02)  # blocked sums
            assert m(x[:1]).shape == (1, m.out_features)  # a few rows: the kernel
