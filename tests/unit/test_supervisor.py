"""What `arena up` prints while the stack starts (infra.supervisor.waiting_line)."""

from __future__ import annotations

from infra.supervisor import waiting_line


def test_the_waiting_line_says_which_models_load_and_which_are_resident():
    ready = {
        "filter": 1,
        "delivery": 1,
        "inference": 0,
        "models": {"smollm2-135m": [], "stories-260k": ["inference-1"], "smollm2-135m-brief": []},
    }
    assert waiting_line(ready) == (
        "waiting: filter=1 delivery=1 inference=0; "
        "models: smollm2-135m loading, stories-260k resident, smollm2-135m-brief loading"
    )
    assert waiting_line({"filter": 0, "delivery": 0, "inference": 0}).endswith("models: none listed yet")
