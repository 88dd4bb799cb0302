"""arenaflow behind arenaflow: a second `arena up` (stories-260k, its API keys on) as the
upstream of a first, which serves it as a `backend: upstream` model beside its own
stories-260k, the key read from a file. Through the first's gateway with the openai SDK:
chat (the same answer as the second gives when asked directly), streaming, completions;
a battle of the local and the upstream model and a vote; `arena replay` and `arena audit`
clean on both stacks; the key found in no log, event or metric of the first."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.arena_up import ArenaUp, arena, battle_and_vote
from tests.e2e.test_upstream import assert_key_nowhere

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

KEY = "sk-inner-arena-5d2e8b7c41"
LOCAL, BEHIND = "stories-260k", "stories-behind"


@pytest.fixture(scope="module")
def stacks(tmp_path_factory) -> Iterator[tuple[ArenaUp, ArenaUp]]:
    """The upstream stack, and the stack in front of it: (front, behind)."""
    tmp = tmp_path_factory.mktemp("behind")
    (tmp / "models.yaml").write_text(f"models:\n  - {{name: {LOCAL}, path: stories260K-hf}}\n")
    behind = ArenaUp(
        tmp,
        "--models-config",
        str(tmp / "models.yaml"),
        "--default-model",
        LOCAL,
        env={"ARENA_API_KEYS": json.dumps([KEY])},
    )
    try:
        front_tmp = tmp_path_factory.mktemp("front")
        key_file = front_tmp / "behind.key"
        key_file.write_text(KEY + "\n")
        key_file.chmod(0o600)
        (front_tmp / "models.yaml").write_text(
            "models:\n"
            f"  - {{name: {LOCAL}, path: stories260K-hf}}\n"
            f"  - name: {BEHIND}\n"
            "    backend: upstream\n"
            "    owner: the-other-arena\n"
            f"    upstream: {{base_url: '{behind.url}/v1', model: {LOCAL}, api_key_file: '{key_file}'}}\n"
        )
        front = ArenaUp(front_tmp, "--models-config", str(front_tmp / "models.yaml"), "--default-model", LOCAL)
        try:
            yield front, behind
        finally:
            front.stop()
    finally:
        behind.stop()


def test_chat_streaming_and_completions_through_the_front_stack(stacks):
    front, behind = stacks
    sdk = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", timeout=60, max_retries=0)
    direct = openai.OpenAI(base_url=f"{behind.url}/v1", api_key=KEY, timeout=60, max_retries=0)
    messages = [{"role": "user", "content": "Once upon a time"}]
    done = sdk.chat.completions.create(model=BEHIND, messages=messages, max_tokens=16, seed=7)  # type: ignore[arg-type]
    asked = direct.chat.completions.create(model=LOCAL, messages=messages, max_tokens=16, seed=7)  # type: ignore[arg-type]
    assert done.choices[0].message.content and done.choices[0].message.content == asked.choices[0].message.content
    assert done.usage is not None and done.usage.prompt_tokens > 0 and 0 < done.usage.completion_tokens <= 16

    parts = sdk.chat.completions.create(model=BEHIND, messages=messages, max_tokens=24, stream=True)  # type: ignore[arg-type]
    deltas = [c.choices[0].delta.content or "" for c in parts if c.choices]
    assert sum(1 for d in deltas if d) >= 2

    text = sdk.completions.create(model=BEHIND, prompt="The little dog", max_tokens=8, seed=3)
    alone = direct.completions.create(model=LOCAL, prompt="The little dog", max_tokens=8, seed=3)
    assert text.choices[0].text and text.choices[0].text == alone.choices[0].text


def test_a_battle_against_the_local_model_a_vote_replay_and_audit_on_both(stacks):
    front, behind = stacks
    bid = battle_and_vote(front.url)
    battle = json.dumps(httpx.get(f"{front.url}/arena/battles/{bid}", timeout=30).json())
    assert BEHIND in battle and LOCAL in battle, battle
    r = httpx.post(
        f"{front.url}/v1/chat/completions",
        json={"model": BEHIND, "messages": [{"role": "user", "content": "A cat"}], "max_tokens": 6},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    replay = arena("replay", "--request-id", r.headers["x-request-id"], "--state-dir", str(front.state), env=front.env)
    kinds = [line.split()[1] for line in replay.stdout.splitlines()]
    assert replay.returncode == 0 and kinds[0] == "chat.requested" and kinds[-1] == "chat.completed", replay.stdout
    for stack in (front, behind):  # the front's requests, and the upstream's as the front sent them
        audit = arena("audit", "--since", "1h", "--state-dir", str(stack.state), "--json", env=stack.env)
        assert audit.returncode == 0 and json.loads(audit.stdout)["ok"], audit.stdout
        assert json.loads(audit.stdout)["requests"] > 0


def test_the_key_from_its_file_appears_nowhere_in_the_front_stack(stacks):
    front, _ = stacks
    assert_key_nowhere(front, KEY, BEHIND)
