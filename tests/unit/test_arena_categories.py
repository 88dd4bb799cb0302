"""Battle categories from prompts: deterministic local rules."""

from __future__ import annotations

import pytest

from gateway.arena.categories import CATEGORIES, categorize, hard_criteria, language

pytestmark = pytest.mark.timeout(10)

HARD = (
    "I need to design an algorithm for my company's production database: exactly 3 steps, "
    "step by step, and calculate the accurate cost of each query. Also, how would we optimize it "
    "so our customers see no downtime? Compare two ideas."
)


@pytest.mark.parametrize(
    ("prompts", "expected"),
    [
        (["Once upon a time"], ["creative_writing", "english"]),
        (["Write a short poem about the sea"], ["creative_writing", "english"]),
        (["```python\nprint(1)\n```\nwhy does this fail?"], ["coding", "english"]),
        (["def f(x):\n    return x"], ["coding"]),
        (["What is 12 * 7 and how do you solve x^2 = 4?"], ["english", "math"]),
        (["Hello there", "and then?"], ["english", "multi_turn"]),
        (["¿Cómo estás? Dime qué es la vida"], ["spanish"]),
        (["Qu'est-ce que la vie et pourquoi je suis ici"], ["french"]),
        (["你好，请介绍一下你自己"], ["chinese"]),
        (["日本の首都はどこですか"], ["japanese"]),
        (["Привет, как дела?"], ["russian"]),
        (["word " * 500], ["long_query"]),
        ([HARD], ["coding", "english", "hard_prompts", "math"]),
    ],
)
def test_rules(prompts: list[str], expected: list[str]) -> None:
    assert categorize(prompts) == expected
    assert set(expected) <= set(CATEGORIES)


def test_hard_prompt_criteria_and_determinism() -> None:
    assert len(hard_criteria(HARD)) >= 6
    assert hard_criteria("Once upon a time") == []
    assert categorize([HARD]) == categorize([HARD])
    assert categorize(["Hi"], turns=3) == ["multi_turn"]  # "hi" alone says no language
    assert language("12345") is None
