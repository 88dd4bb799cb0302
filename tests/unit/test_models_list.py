"""`arena models list`'s table: which process each block is, and a variant's memory as its base's."""

from __future__ import annotations

from events.admin import ModelDetails, ModelsAnswer
from infra.commands.models import table


def _loaded(name: str, base: str | None = None) -> ModelDetails:
    return ModelDetails(
        name=name,
        source="smollm2.gguf",
        base=base,
        context=2048,
        quantize=None,
        resident=True,
        parameters=134_500_000,
        dtype="bfloat16",
        chat_template=True,
        resident_bytes=538_000_000,  # a variant reports its base's weights
    )


def test_a_block_names_its_process_and_a_variant_shares_its_base_weights():
    answer = ModelsAnswer(ok=True, instance="host-4711", details=(_loaded("smollm2"), _loaded("pirate", "smollm2")))
    lines = table([answer]).split("\n")
    assert lines[0] == "inference process host-4711:"
    base = next(line for line in lines if line.startswith("smollm2 "))
    variant = next(line for line in lines if line.startswith("pirate "))
    assert base.endswith("538 MB")
    assert variant.endswith("shares smollm2's weights") and "(variant of smollm2)" in variant
