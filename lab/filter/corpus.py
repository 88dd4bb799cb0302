"""The labelled prompt corpora and how their sources group into families.

One JSON object a line: ``{"text": str, "label": "attack" | "benign", "source": str}``.
A *family* is the unit held out in leave-one-source-out evaluation: one public
collection (a repository), so that every template, context and author style of
that collection is unseen when it is tested.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Row", "family_of", "load_rows"]

# PurpleLlama ships two unrelated sets: the prompt-injection tests (English, and the
# same tests machine-translated) and the MITRE false-refusal prompts. The translated
# tests must be held out with the English ones, or each leaks into the other's fold.
# Every other repository is one family.
_SPLIT_BY_SUBSET = ("meta-llama/PurpleLlama",)
_SAME_COLLECTION = {
    "cyberseceval-prompt-injection-en": "cyberseceval-prompt-injection",
    "cyberseceval-prompt-injection-multilingual": "cyberseceval-prompt-injection",
}


@dataclass(frozen=True)
class Row:
    text: str
    attack: bool
    source: str
    family: str


def family_of(source: str) -> str:
    """'microsoft/BIPIA:email-injected/X' -> 'microsoft/BIPIA'; JailbreakBench -> its attack method.

    PurpleLlama: 'meta-llama/PurpleLlama:cyberseceval-prompt-injection' (English and
    translated tests together) or 'meta-llama/PurpleLlama:cyberseceval-mitre-frr'.
    """
    repo, _, subset = source.partition(":")
    if repo == "jailbreakbench-artifacts":
        return "JBB/" + subset.split("/", 1)[0]
    if repo in _SPLIT_BY_SUBSET:
        subset = subset.split("/", 1)[0]
        return f"{repo}:{_SAME_COLLECTION.get(subset, subset)}"
    return repo


def load_rows(path: str | Path, limit: int | None = None) -> list[Row]:
    """Every row of a JSONL corpus (the first ``limit`` per family when given)."""
    rows: list[Row] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            item = json.loads(line)
            fam = family_of(item["source"])
            if limit is not None:
                if seen.get(fam, 0) >= limit:
                    continue
                seen[fam] = seen.get(fam, 0) + 1
            rows.append(Row(item["text"], item["label"] == "attack", item["source"], fam))
    return rows
