"""The conversion's sign of life (consumers.inference.sources.ticking)."""

from __future__ import annotations

import threading
import time

from consumers.inference.sources import ticking


def test_a_long_step_says_it_is_still_running_until_it_ends():
    said: list[str] = []
    with ticking(said.append, "still dequantizing", every=0.05):
        time.sleep(0.18)
    count = len(said)
    assert count >= 2 and all(line.startswith("still dequantizing: ") and line.endswith(" s") for line in said)
    time.sleep(0.12)
    assert len(said) == count  # nothing after the block
    assert not any(t.name == "convert-progress" for t in threading.enumerate())
