"""The private arena through the real pipeline: battles, both sides streamed, votes,
identities kept secret until the vote, the live leaderboard and the operator commands."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.arena_up import ArenaUp
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CONFIG = REPO / "configs" / "stories-arena.yaml"
#: Seconds an arena stack may take to be ready: on a loaded 2-core box the inference
#: worker's imports alone took 28 s, and 90 s was not always enough.
START_S = 240.0
MODELS = ("stories-260k", "stories-260k-creative", "stories-260k-focused")
# Any spelling of a served name ("stories-260k", "Stories 260K", ...).
LEAK = re.compile(r"stories[\s_\-./:]*260k|creative|focused", re.IGNORECASE)


@pytest.fixture(scope="module")
def arena(module_stack_factory):
    return module_stack_factory(ARENA_MODELS_CONFIG=CONFIG).start(timeout=START_S)


def raw(response: httpx.Response, body: str | None = None) -> str:
    """Every byte the client got: status line, headers and body."""
    head = "\n".join(f"{k}: {v}" for k, v in response.headers.items())
    return f"{response.status_code}\n{head}\n{response.text if body is None else body}"


def turn(client: httpx.Client, battle_id: str, prompt: str) -> tuple[str, dict]:
    with client.stream("POST", f"/arena/battles/{battle_id}/turns", json={"prompt": prompt, "max_tokens": 24}) as r:
        body = "".join(r.iter_text())
        assert r.status_code == 200, body
        seen = raw(r, body)
    frames = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    assert body.rstrip().endswith("data: [DONE]")
    texts = {"a": "", "b": ""}
    for f in frames:
        assert f["model"] == f"model_{f['side']}" and "error" not in f
        texts[f["side"]] += f["delta"].get("content", "")
    assert {f["side"] for f in frames if f["finish_reason"]} == {"a", "b"}
    return seen, texts


def arena_cmd(stack, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *args, "--nats-url", stack.nats.url],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_default_arena_config_serves_three_models(arena):
    ids = {m["id"] for m in httpx.get(f"{arena.url}/v1/models").json()["data"]}
    assert set(MODELS) <= ids


def test_a_battle_keeps_identities_secret_until_the_vote(arena):
    seen = []
    with httpx.Client(base_url=arena.url, timeout=60) as client:
        r = client.post("/arena/battles")
        seen.append(raw(r))
        assert r.status_code == 201, r.text
        battle = r.json()
        bid = battle["battle_id"]
        assert (battle["model_a"], battle["model_b"], battle["state"]) == ("model_a", "model_b", "open")
        early = client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"})
        seen.append(raw(early))
        assert early.status_code == 409 and early.json()["error"]["code"] == "not_answered"
        got, first = turn(client, bid, "Once upon a time")
        seen.append(got)
        assert first["a"] and first["b"]
        got, second = turn(client, bid, "Then the dog ran home")
        assert second["a"] and second["b"]
        seen.append(got)
        view = client.get(f"/arena/battles/{bid}")
        seen.append(raw(view))
        assert view.json()["turns"] == 2 and view.json()["model_a"] == "model_a"
        bad = client.post(f"/arena/battles/{bid}/vote", json={"choice": "left"})
        seen.append(raw(bad))
        assert bad.status_code == 400 and "error" in bad.json()
        assert not [s for s in seen if LEAK.search(s)], "a model name reached the client before the vote"

        voted = client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"}).json()
        assert {voted["model_a"], voted["model_b"]} <= set(MODELS) and voted["model_a"] != voted["model_b"]
        assert voted["state"] == "voted" and voted["counted"] is True
        assert client.get(f"/arena/battles/{bid}").json()["model_a"] == voted["model_a"]
        again = client.post(f"/arena/battles/{bid}/vote", json={"choice": "b"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "already_voted"
        closed = client.post(f"/arena/battles/{bid}/turns", json={"prompt": "more"})
        assert closed.status_code == 409
        assert client.get("/arena/battles/nope").status_code == 404

    replay = arena_cmd(arena, "replay", "--battle-id", bid)
    assert replay.returncode == 0, replay.stderr
    assert "battle.started" in replay.stdout and "vote.cast" in replay.stdout
    assert replay.stdout.count("chat.completed") == 4


def test_leaderboard_is_live_and_recomputed_from_the_stream(arena, tmp_path):
    with httpx.Client(base_url=arena.url, timeout=60) as client:
        for choice in ("b", "tie"):
            bid = client.post("/arena/battles").json()["battle_id"]
            turn(client, bid, "A cat")
            assert client.post(f"/arena/battles/{bid}/vote", json={"choice": choice}).status_code == 200
        end = time.monotonic() + 10
        while (board := client.get("/arena/leaderboard").json())["total_votes"] < 3 and time.monotonic() < end:
            time.sleep(0.3)
        assert board["total_votes"] >= 3 and board["digest"], board
        assert {r["model"] for r in board["rows"]} <= set(MODELS)
        assert all(r["ci_low"] <= r["rating"] <= r["ci_high"] for r in board["rows"])
        csv = client.get("/arena/leaderboard", params={"format": "csv"})
        assert csv.headers["content-type"].startswith("text/csv")
        assert csv.text.splitlines()[0].startswith("rank,model,rating")

    again = arena_cmd(arena, "leaderboard", "--at", str(board["seq"]), "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["digest"] == board["digest"]

    audit = arena_cmd(arena, "audit", "--json")
    report = json.loads(audit.stdout)
    assert report["votes_without_battle"] == [] and report["battles_with_several_votes"] == []

    path = tmp_path / "clean_battle.json"
    path.write_text(json.dumps([{"model_a": "gpt-x", "model_b": "llama-y", "winner": "model_a", "tstamp": 1.7e9}]))
    imported = arena_cmd(arena, "battles", "import", str(path))
    assert imported.returncode == 0, imported.stderr
    assert "imported 1 new votes" in imported.stdout, imported.stdout
    again = arena_cmd(arena, "battles", "import", str(path))  # the same file: nothing new
    assert "imported 0 new votes" in again.stdout and "(1 of its 1 already in the stream)" in again.stdout
    end = time.monotonic() + 10
    while "gpt-x" not in {r["model"] for r in httpx.get(f"{arena.url}/arena/leaderboard").json()["rows"]}:
        assert time.monotonic() < end, "imported votes did not reach the leaderboard"
        time.sleep(0.3)
    exported = arena_cmd(arena, "battles", "export", str(tmp_path / "out.json"))
    assert exported.returncode == 0, exported.stderr
    rows = json.loads((tmp_path / "out.json").read_text())
    assert len(rows) >= 4 and {"model_a": "gpt-x", "model_b": "llama-y", "winner": "model_a", "tstamp": 1.7e9} in [
        {k: r[k] for k in ("model_a", "model_b", "winner", "tstamp")} for r in rows
    ]


def test_an_operator_invalidates_and_reinstates_a_vote(arena):
    def votes_become(n: int) -> None:
        end = time.monotonic() + 10
        while httpx.get(f"{arena.url}/arena/leaderboard").json()["total_votes"] != n:
            assert time.monotonic() < end, f"the leaderboard did not reach {n} votes"
            time.sleep(0.2)

    with httpx.Client(base_url=arena.url, timeout=60) as client:
        before = client.get("/arena/leaderboard").json()["total_votes"]
        bid = client.post("/arena/battles").json()["battle_id"]
        turn(client, bid, "A frog")
        assert client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"}).status_code == 200
    votes_become(before + 1)
    # Invalidated, reinstated and invalidated again: three facts, none dropped as a duplicate.
    for op, expected in (("invalidate", before), ("reinstate", before + 1), ("invalidate", before)):
        done = arena_cmd(arena, "battles", op, bid, "--reason", "checked by hand")
        assert done.returncode == 0, done.stderr
        votes_become(expected)
    again = arena_cmd(arena, "battles", "invalidate", bid, "--reason", "twice")
    assert again.returncode == 0 and "already does not count" in again.stdout
    assert arena_cmd(arena, "battles", "reinstate", "no-such-battle", "--reason", "x").returncode == 1
    replay = arena_cmd(arena, "replay", "--battle-id", bid)
    assert replay.stdout.count("vote.invalidated") == 2 and replay.stdout.count("vote.reinstated") == 1
    assert "operator" in replay.stdout  # who decided is on the record


def test_a_vote_whose_answer_named_its_own_model_does_not_count(stack_factory, tmp_path):
    """Identity leak, end to end: two contestants named after a word the tiny model says
    ("Once upon a time, there was a little girl named Lily"), greedy, so an answer names
    the model `lily` (FastChat's rule: any model of the arena, or a maker, named in an
    answer); the vote is cast, then invalidated by the identity_leak rule."""
    config = tmp_path / "leaky.yaml"
    config.write_text(
        "models:\n  - {name: stories-260k, path: stories260K-hf}\n"
        "  - {name: lily, base: stories-260k, temperature: 0}\n"
        "  - {name: ben, base: stories-260k, temperature: 0}\n"
    )
    s = stack_factory(ARENA_MODELS_CONFIG=config, ARENA_ARENA_WEIGHTS='{"lily": 1, "ben": 1}').start(timeout=START_S)
    with httpx.Client(base_url=s.url, timeout=60) as client:
        bid = client.post("/arena/battles").json()["battle_id"]
        _, texts = turn(client, bid, "Once upon a time")
        voted = client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"})
        assert voted.status_code == 200, voted.text
        view = voted.json()
    lily_side = "a" if view["model_a"] == "lily" else "b"
    assert {view["model_a"], view["model_b"]} == {"lily", "ben"}
    assert "Lily" in texts[lily_side], texts  # the premise: the answer names its own model
    assert view["counted"] is False and view["invalid_reason"].startswith("identity_leak"), view
    assert "names 'lily'" in view["invalid_reason"]
    replay = arena_cmd(s, "replay", "--battle-id", bid)
    assert "vote.invalidated" in replay.stdout and '"detector": "identity_leak"' in replay.stdout
    report = json.loads(arena_cmd(s, "audit", "--json").stdout)
    assert report["votes_not_counted"] == {"identity_leak": [bid]}
    assert 'arena_votes_not_counted_total{rule="identity_leak"} 1.0' in httpx.get(f"{s.url}/metrics").text


def test_style_controlled_board_on_live_battles_and_an_imported_file(arena, tmp_path):
    with httpx.Client(base_url=arena.url, timeout=60) as client:
        for choice in ("a", "b", "tie"):
            bid = client.post("/arena/battles").json()["battle_id"]
            turn(client, bid, "A bird")
            assert client.post(f"/arena/battles/{bid}/vote", json={"choice": choice}).status_code == 200
        end = time.monotonic() + 10
        while (board := client.get("/arena/leaderboard", params={"style_control": True}).json())["total_votes"] < 3:
            assert time.monotonic() < end, board
            time.sleep(0.3)
    assert board["style_control"] and list(board["style_coefficients"]) == ["length", "header", "list", "bold"]
    assert {r["model"] for r in board["rows"]} <= set(MODELS) and board["digest"]
    again = arena_cmd(arena, "leaderboard", "--style-control", "--json", "--at", str(board["seq"]))
    assert again.returncode == 0, again.stderr
    cli = json.loads(again.stdout)
    assert cli["digest"] == board["digest"] and list(cli["style_coefficients"]) == list(board["style_coefficients"])
    assert all({"model", "rating"} <= set(r) for r in cli["rows"])

    # The vote recorded each side's answer tokens as the model's tokenizer counted them.
    replay = arena_cmd(arena, "replay", "--battle-id", bid, "--json")
    events = [json.loads(line) for line in replay.stdout.splitlines()]
    [cast] = [e for e in events if e["type"] == "vote.cast"]
    [battle_turn] = [e for e in events if e["type"] == "battle.turn"]
    usage = {e["request_id"]: e["usage"]["completion_tokens"] for e in events if e["type"] == "chat.completed"}
    meta = cast["conv_metadata"]
    assert meta["sum_assistant_a_tokens"] == usage[battle_turn["request_a"]] > 0
    assert meta["sum_assistant_b_tokens"] == usage[battle_turn["request_b"]] > 0
    assert set(meta["header_count_a"]) == {f"h{n}" for n in range(1, 7)}

    rows = []
    for k in range(60):  # a FastChat clean-battle file with conv_metadata: the longer answer mostly wins
        long_a = k % 2 == 0
        meta = {"sum_assistant_a_tokens": 400 if long_a else 80, "sum_assistant_b_tokens": 80 if long_a else 400}
        for side in "ab":
            meta |= {f"header_count_{side}": {"h1": k % 3}, f"list_count_{side}": {"ordered": 0, "unordered": k % 2}}
            meta |= {f"bold_count_{side}": {"**": 0, "__": 0}}
        winner = ("model_a" if long_a else "model_b") if k % 5 else "tie"
        pair = ("imp-x", "imp-y") if k % 3 else ("imp-y", "imp-z")
        rows.append(
            {"model_a": pair[0], "model_b": pair[1], "winner": winner, "tstamp": 1.7e9 + k, "conv_metadata": meta}
        )
    path = tmp_path / "clean_battle_conv.json"
    path.write_text(json.dumps(rows))
    assert arena_cmd(arena, "battles", "import", str(path)).returncode == 0
    styled = json.loads(arena_cmd(arena, "leaderboard", "--style-control", "--json").stdout)
    assert {"imp-x", "imp-y", "imp-z"} <= {r["model"] for r in styled["rows"]}
    assert styled["style_coefficients"]["length"] > 0.5  # the length effect planted in the file
    assert arena_cmd(arena, "battles", "export", str(tmp_path / "out.json")).returncode == 0
    out = {(r["model_a"], r["tstamp"]): r for r in json.loads((tmp_path / "out.json").read_text()) if "tstamp" in r}
    assert out[("imp-x", 1.7e9 + 1)]["conv_metadata"] == rows[1]["conv_metadata"]


def test_a_turn_cut_off_by_the_client_says_how_to_vote(arena):
    """The client goes away mid-answer: both sides are cancelled, the vote's 409 says to send
    the prompt again, and after a whole turn the vote counts."""
    with httpx.Client(base_url=arena.url, timeout=60) as client:
        for _ in range(5):  # the tiny model can finish both answers before the cancel lands: cut again
            bid = client.post("/arena/battles").json()["battle_id"]
            body = {"prompt": "Once upon a time", "max_tokens": 400}
            with client.stream("POST", f"/arena/battles/{bid}/turns", json=body) as r:
                next(r.iter_lines())  # the first frame, then hang up
            end = time.monotonic() + 20
            while (refused := client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"})).status_code == 409:
                if refused.json()["error"]["code"] != "not_answered" or time.monotonic() > end:
                    break
                time.sleep(0.2)
            if refused.status_code == 409:
                break
        error = refused.json()["error"]
        assert refused.status_code == 409 and error["code"] == "turn_incomplete", refused.text
        assert "send the prompt again" in error["message"] and f"/arena/battles/{bid}/turns" in error["message"]
        assert not LEAK.search(refused.text)
        turn(client, bid, "Once upon a time")
        voted = client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"})
        assert voted.status_code == 200 and voted.json()["counted"] is True, voted.text


def ended_frames(lines) -> list[dict]:
    """The frames read from an arena turn's SSE lines up to the next side's last frame."""
    frames = []
    for line in lines:
        if line.startswith("data: {"):
            frames.append(json.loads(line[6:]))
            if frames[-1]["finish_reason"]:
                return frames
    return frames


def test_a_side_its_worker_refuses_stops_the_other(tmp_path):
    """Both sides or neither: a variant whose default answer length leaves no room for a
    prompt in the model's 512-token context is refused by its worker (its gateway checks
    pass), and the other side, held by a stalled engine meanwhile, is stopped rather than
    answered; the turn is not offered for a vote."""
    config = tmp_path / "models.yaml"
    config.write_text(
        f"models:\n  - {{name: {MODELS[0]}, path: stories260K-hf}}\n"
        f"  - {{name: {MODELS[0]}-long, base: {MODELS[0]}, max_tokens: 510}}\n"
    )
    up = ArenaUp(tmp_path, "--models-config", str(config), "--default-model", MODELS[0], ready_s=START_S)
    try:
        with httpx.Client(base_url=up.url, timeout=60) as client:
            bid = client.post("/arena/battles").json()["battle_id"]
            # Stalled before the turn: stories-260k answers in a few ms, so an engine stopped
            # once the turn began could have answered the other side first.
            with contextlib.ExitStack() as stalled:
                stalled.enter_context(up.engines_stalled())
                with client.stream("POST", f"/arena/battles/{bid}/turns", json={"prompt": "Once upon a time"}) as r:
                    assert r.status_code == 200
                    lines = r.iter_lines()
                    refused = ended_frames(lines)[-1]
                    # The other side's stop (core NATS, then the worker's pipe to its engine)
                    # reaches the engine while it stands still: 0.5 s was short under load.
                    time.sleep(2.0)
                    stalled.close()
                    stopped = ended_frames(lines)[-1]
            assert refused["error"]["code"] == "context_length_exceeded", refused
            assert stopped["side"] != refused["side"] and stopped.get("error", {}).get("code") == "cancelled", stopped
            vote = client.post(f"/arena/battles/{bid}/vote", json={"choice": "a"})
            assert vote.status_code == 409 and vote.json()["error"]["code"] == "turn_incomplete", vote.text
    finally:
        up.stop()


def test_boards_per_category_live_from_an_import_and_refused_for_an_unknown_name(arena, tmp_path):
    with httpx.Client(base_url=arena.url, timeout=60) as client:
        bid = client.post("/arena/battles").json()["battle_id"]
        turn(client, bid, "Write a short poem about the sea")
        assert client.post(f"/arena/battles/{bid}/vote", json={"choice": "b"}).status_code == 200
        end = time.monotonic() + 10
        while "creative_writing" not in (raw := client.get("/arena/leaderboard").json())["categories"]:
            assert time.monotonic() < end, raw
            time.sleep(0.3)
        board = client.get("/arena/leaderboard", params={"category": "creative_writing"}).json()
        assert board["category"] == "creative_writing" and 1 <= board["total_votes"] <= raw["total_votes"]
        assert board["total_votes"] == raw["categories"]["creative_writing"] and board["rows"]
        bad = client.get("/arena/leaderboard", params={"category": "poetry"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "category"
    again = arena_cmd(arena, "leaderboard", "--category", "creative_writing", "--json", "--at", str(board["seq"]))
    assert json.loads(again.stdout)["digest"] == board["digest"]
    replay = arena_cmd(arena, "replay", "--battle-id", bid, "--json")
    [cast] = [json.loads(line) for line in replay.stdout.splitlines() if '"vote.cast"' in line]
    assert cast["categories"] == ["creative_writing", "english"]

    code = [
        {"role": "user", "content": "```python\nprint(1)\n```\nwhy does this fail?"},
        {"role": "assistant", "content": "ok"},
    ]
    rows = [
        {"model_a": "cat-x", "model_b": "cat-y", "winner": "model_a", "tstamp": 1.8e9 + k, "conversation_a": code}
        for k in range(3)
    ]
    path = tmp_path / "clean_battle_conv.json"
    path.write_text(json.dumps(rows))
    assert arena_cmd(arena, "battles", "import", str(path)).returncode == 0
    coding = json.loads(arena_cmd(arena, "leaderboard", "--category", "coding", "--json").stdout)
    assert {r["model"] for r in coding["rows"]} == {"cat-x", "cat-y"} and coding["total_votes"] == 3
    refused = arena_cmd(arena, "leaderboard", "--category", "poetry")
    assert refused.returncode == 2 and "is not one of" in refused.stderr


def test_active_sampling_is_recorded_on_each_battle(stack_factory):
    """ARENA_ARENA_SAMPLING=active: with no votes yet every pair is as informative, and the
    battle records the policy (every model under 3,000 votes is boosted) and its probability."""
    from gateway.arena.pairing import PairPolicy

    s = stack_factory(ARENA_MODELS_CONFIG=CONFIG, ARENA_ARENA_SAMPLING="active").start(timeout=START_S)
    with httpx.Client(base_url=s.url, timeout=60) as client:
        end = time.monotonic() + 30
        while (r := client.post("/arena/battles")).status_code == 503:
            assert time.monotonic() < end, r.text
            time.sleep(0.3)
        bid = r.json()["battle_id"]
    replay = arena_cmd(s, "replay", "--battle-id", bid, "--json")
    [started] = [json.loads(line) for line in replay.stdout.splitlines() if '"battle.started"' in line]
    assert started["pair_probability"] == pytest.approx(1 / 3)
    assert started["policy_version"] == PairPolicy(boost=tuple(sorted(MODELS)), sampling="active").version
