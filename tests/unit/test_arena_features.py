"""A vote's style record: FastChat's markdown counts, transcribed in the test and compared."""

from __future__ import annotations

import re

import pytest

from consumers.leaderboard.style_control import style_counts
from gateway.arena.features import conv_metadata, markdown_counts

pytestmark = pytest.mark.timeout(10)


def fastchat_count_markdown_elements(markdown_text, suffix):
    """fastchat/serve/monitor/add_markdown_info.py, `count_markdown_elements`."""
    return {
        f"header_count{suffix}": {
            f"h{n}": len(re.findall(rf"^#{{{n}}}\s", markdown_text, re.MULTILINE)) for n in range(1, 7)
        },
        f"list_count{suffix}": {
            "ordered": len(re.findall(r"^\s*\d+\.\s", markdown_text, re.MULTILINE)),
            "unordered": len(re.findall(r"^\s*[-*+]\s", markdown_text, re.MULTILINE)),
        },
        f"bold_count{suffix}": {
            "**": len(re.findall(r"\*\*[^*\n]+\*\*", markdown_text)),
            "__": len(re.findall(r"__[^_\n]+__", markdown_text)),
        },
    }


def fastchat_remove_pattern(answer, pattern):
    for block in pattern.findall(answer):
        answer = answer.replace(block, "")
    return answer


ANSWER = """# Title
Some **bold** text and __more__.
## Steps
1. first
2. second
   - nested
* star item
```python
# not a header
- not a list
**not bold**
```
### End
"""


def test_counts_equal_fastchat_on_markdown_with_code() -> None:
    expected = fastchat_count_markdown_elements(fastchat_remove_pattern(ANSWER, re.compile("```([^`]*)```")), "_a")
    got = markdown_counts(ANSWER, "a")
    assert got == expected
    assert got["header_count_a"]["h1"] == 1 and got["header_count_a"]["h2"] == 1 and got["header_count_a"]["h3"] == 1
    assert got["list_count_a"] == {"ordered": 2, "unordered": 2} and got["bold_count_a"] == {"**": 1, "__": 1}


def test_conv_metadata_joins_turns_and_reads_as_style_counts() -> None:
    meta = conv_metadata({"a": ["# One", "- x\n- y"], "b": ["plain"]}, {"a": 12, "b": 3})
    assert meta["sum_assistant_a_tokens"] == 12 and meta["sum_assistant_b_tokens"] == 3
    assert style_counts(meta) == (12.0, 1.0, 2.0, 0.0, 3.0, 0.0, 0.0, 0.0)
