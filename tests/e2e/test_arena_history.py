"""The arena's public model history on the real stack: a model withdrawn by the operator
stays listed with its votes and owner, leaves the pairing, and the history replays at a
past stream sequence exactly as it was then."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.e2e.test_arena_battles import CONFIG, MODELS, START_S, arena_cmd, turn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WITHDRAWN = "stories-260k-focused"


@pytest.fixture(scope="module")
def arena(module_stack_factory):
    return module_stack_factory(ARENA_MODELS_CONFIG=CONFIG).start(timeout=START_S)


def history_until(client: httpx.Client, check, what: str) -> dict:
    end = time.monotonic() + 20
    while not check(doc := client.get("/arena/history").json()):
        assert time.monotonic() < end, f"{what}: {doc}"
        time.sleep(0.3)
    return doc


def battles(doc: dict) -> dict[str, int]:
    return {m["model"]: m["battles"] for m in doc["models"]}


def test_a_withdrawn_model_stays_in_the_history_and_leaves_the_pairing(arena):
    with httpx.Client(base_url=arena.url, timeout=60) as client:
        seen: set[str] = set()
        counted = 0
        while len(seen) < len(MODELS) or counted < 6:  # every model battles, with votes counted
            assert counted < 30, seen
            bid = client.post("/arena/battles").json()["battle_id"]
            turn(client, bid, "Once upon a time")
            voted = client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"}).json()
            seen |= {voted["model_a"], voted["model_b"]}
            counted += bool(voted["counted"])
        before = history_until(
            client, lambda d: sum(m["votes"] for m in d["models"]) == 2 * counted, "every counted vote is folded"
        )
        rows = {m["model"]: m for m in before["models"]}
        assert set(rows) == set(MODELS)
        assert all(r["owner"] == "karpathy" and r["status"] == "active" and r["served"] for r in rows.values())
        assert before["owners"] == [{"owner": "karpathy", "variants": 3, "active": 3, "withdrawn": 0}]

        done = arena_cmd(arena, "models", "withdraw", "--name", WITHDRAWN, "--reason", "private test over")
        assert done.returncode == 0 and "model.withdrawn" in done.stdout, done.stderr
        again = arena_cmd(arena, "models", "withdraw", "--name", WITHDRAWN, "--reason", "twice")
        assert again.returncode == 0 and "already withdrawn" in again.stdout
        typo = arena_cmd(arena, "models", "withdraw", "--name", "stories-999k", "--reason", "x")
        assert typo.returncode == 1 and "never entered the arena" in typo.stderr
        assert arena_cmd(arena, "models", "withdraw", "--name", WITHDRAWN).returncode != 0  # --reason is required

        after = history_until(
            client, lambda d: any(m["status"] == "withdrawn" for m in d["models"]), "the withdrawal is folded"
        )
        row = next(m for m in after["models"] if m["model"] == WITHDRAWN)
        assert (row["status"], row["reason"], row["owner"], row["served"]) == (
            "withdrawn",
            "private test over",
            "karpathy",
            True,
        )
        assert row["votes"] == rows[WITHDRAWN]["votes"] and row["changed_seq"] > before["seq"]
        assert after["owners"] == [{"owner": "karpathy", "variants": 3, "active": 2, "withdrawn": 1}]
        # Still rated on the board: a withdrawal takes no vote away.
        board = client.get("/arena/leaderboard").json()
        assert WITHDRAWN in {r["model"] for r in board["rows"]}

        # No new battle pairs it: the other two meet each time.
        for _ in range(5):
            assert client.post("/arena/battles").status_code == 201
        later = history_until(client, lambda d: sum(battles(d).values()) == sum(battles(after).values()) + 10, "5 more")
        assert battles(later)[WITHDRAWN] == battles(after)[WITHDRAWN]
        assert all(battles(later)[m] == battles(after)[m] + 5 for m in MODELS if m != WITHDRAWN)

    # The stream replays the history as it was at any past sequence.
    then = json.loads(arena_cmd(arena, "leaderboard", "--history", "--json", "--at", str(before["seq"])).stdout)
    assert then == {k: v for k, v in before.items() if k != "models"} | {
        "models": [{k: v for k, v in m.items() if k != "served"} for m in before["models"]]
    }
    at_withdrawal = arena_cmd(arena, "leaderboard", "--history", "--json", "--at", str(row["changed_seq"]))
    assert json.loads(at_withdrawal.stdout)["owners"] == after["owners"]
    text = arena_cmd(arena, "leaderboard", "--history").stdout
    assert "variants per owner: karpathy 3 (1 withdrawn)" in text
    assert any(
        line.startswith(WITHDRAWN) and "withdrawn" in line and "private test over" in line for line in text.splitlines()
    )

    back = arena_cmd(arena, "models", "reinstate", "--name", WITHDRAWN, "--reason", "a mistake")
    assert back.returncode == 0 and "model.reinstated" in back.stdout
    replay = arena_cmd(arena, "leaderboard", "--history", "--json")
    reinstated = next(m for m in json.loads(replay.stdout)["models"] if m["model"] == WITHDRAWN)
    assert reinstated["status"] == "active" and reinstated["reason"] == "a mistake"


def test_a_model_no_longer_served_stays_listed_as_not_served(arena):
    """`arena models remove` takes a model off the inference process (as a restart without
    it in the models config would): it stays in the history, marked as not served."""
    removed = arena_cmd(arena, "models", "remove", "--name", "stories-260k-creative")
    assert removed.returncode == 0, removed.stdout + removed.stderr
    with httpx.Client(base_url=arena.url, timeout=60) as client:
        doc = history_until(
            client,
            lambda d: any(m["model"] == "stories-260k-creative" and not m["served"] for m in d["models"]),
            "the model is shown as not served",
        )
    row = next(m for m in doc["models"] if m["model"] == "stories-260k-creative")
    assert row["status"] == "active" and row["votes"] > 0 and len(doc["models"]) == len(MODELS)


def test_style_control_per_category_on_live_battles_and_an_imported_file(arena, tmp_path):
    """`arena leaderboard --style-control --category NAME --json` (the API serves one or the other)."""
    out = arena_cmd(arena, "leaderboard", "--style-control", "--category", "english", "--json")
    board = json.loads(out.stdout)
    assert board["category"] == "english" and board["style_control"] is True and board["total_votes"] >= 6
    assert list(board["style_coefficients"]) == ["length", "header", "list", "bold"]
    assert {r["model"] for r in board["rows"]} <= set(MODELS) and all("rating" in r for r in board["rows"])

    code = [{"role": "user", "content": "```python\nprint(1)\n```\nwhy does this fail?"}]
    rows = []
    for k in range(12):  # coding battles with style counts, as a FastChat clean-battle file has them
        meta = {"sum_assistant_a_tokens": 100 + k, "sum_assistant_b_tokens": 90}
        for side in "ab":
            meta |= {f"header_count_{side}": {"h1": k % 2}, f"list_count_{side}": {"ordered": 0}}
            meta |= {f"bold_count_{side}": {"**": 0}}
        winner = ("model_a", "model_b", "tie")[k % 3]
        rows.append(
            {"model_a": "code-x", "model_b": "code-y", "winner": winner, "tstamp": 1.9e9 + k}
            | {"conv_metadata": meta, "conversation_a": code}
        )
    path = tmp_path / "clean_battle_code.json"
    path.write_text(json.dumps(rows))
    assert arena_cmd(arena, "battles", "import", str(path)).returncode == 0
    coding = json.loads(arena_cmd(arena, "leaderboard", "--style-control", "--category", "coding", "--json").stdout)
    assert {r["model"] for r in coding["rows"]} == {"code-x", "code-y"} and coding["total_votes"] == 12
    assert list(coding["style_coefficients"]) == ["length", "header", "list", "bold"]
    # Imported models enter the history too, with no owner known.
    history = json.loads(arena_cmd(arena, "leaderboard", "--history", "--json").stdout)
    assert {"owner": None, "variants": 2, "active": 2, "withdrawn": 0} in history["owners"]
