"""`arena up` with API keys on (`ARENA_API_KEYS`), used the way its operator and its
voters use it: the arena page asks for a key, refuses a wrong one and plays a battle
with the right one; `arena top` sees the gateway up; Debian's Prometheus, on the
configuration `arena up` wrote, scrapes every target, the gateway's included. No key
reaches the page, a URL or a log."""

from __future__ import annotations

import json

import httpx
import pytest

from events import topology
from infra.monitoring import top
from tests.arena_up import ArenaUp, arena
from tests.e2e.test_arena_page import play_round
from tests.prometheus import active_targets, query, run_prometheus, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "sk-voter-test-5e6f7a8b9c"
WRONG = "sk-not-a-key-0000"


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    stack = ArenaUp(tmp_path_factory.mktemp("keys"), env={"ARENA_API_KEYS": json.dumps([KEY])})
    assert httpx.post(f"{stack.url}/arena/battles").status_code == 401  # keys are on
    yield stack
    stack.stop()


def new_battle_shown(page) -> None:
    page.wait_for_function("document.querySelector('#status').textContent.startsWith('New battle')")


def test_the_page_asks_for_a_key_refuses_a_wrong_one_and_plays_with_the_right_one(up, browser):
    page = browser.new_page(viewport={"width": 1100, "height": 760})
    sent: list[tuple[str, str | None]] = []
    page.on("request", lambda r: sent.append((r.url, r.headers.get("authorization"))))
    page.goto(f"{up.url}/arena")
    page.wait_for_selector("#key-form:not([hidden])")
    assert "needs an API key" in page.inner_text("#key-message")
    page.fill("#key-input", WRONG)
    page.click("#key-submit")
    page.wait_for_function("document.querySelector('#key-message').textContent.startsWith('That key was refused')")
    assert "invalid API key" in page.inner_text("#key-message") and page.is_visible("#key-form")
    assert page.evaluate("sessionStorage.length + localStorage.length") == 0  # the wrong key is not kept

    page.fill("#key-input", KEY)
    page.click("#key-submit")
    new_battle_shown(page)
    assert page.is_hidden("#key-form") and page.is_visible("#forget-key")
    play_round(page, "Once upon a time")
    page.click(".votes button[data-choice='a']")
    page.wait_for_selector("#reveal:not([hidden])")
    assert "Your vote counts" in page.inner_text("#reveal")

    page.goto(f"{up.url}/arena/board")  # the tab keeps the key: no form, the vote is on the board
    page.wait_for_selector("#rows tr", timeout=20_000)
    assert page.is_hidden("#key-form")
    page.goto(f"{up.url}/arena")
    new_battle_shown(page)
    page.click("#forget-key")  # forgotten: the next call asks again
    page.wait_for_selector("#key-form:not([hidden])")

    api_calls = [(url, auth) for url, auth in sent if "/arena/battles" in url or "/arena/leaderboard" in url]
    assert {auth for _, auth in api_calls} == {None, f"Bearer {WRONG}", f"Bearer {KEY}"}
    assert sum(auth == f"Bearer {KEY}" for _, auth in api_calls) >= 4  # start, turn, vote, board
    assert not [url for url, _ in sent if KEY in url or WRONG in url]
    shell = "".join(httpx.get(f"{up.url}{p}").text for p in ("/arena", "/arena/board", "/arena/static/key.js"))
    assert KEY not in shell


def test_arena_top_sees_the_gateway_up(up):
    assert httpx.get(f"{up.url}/metrics").status_code == 401  # the API port wants a key
    with httpx.Client(timeout=2) as client:
        seen = top.scrape(top.targets(up.state), client)
    [gateway] = [p for p in seen.processes if p.role == topology.GATEWAY.name]
    assert gateway.up and gateway.ready, gateway.address
    assert seen.most("arena_fleet_processes", role=topology.INFERENCE.name) == 1  # the gateway's own series
    assert all(p.up for p in seen.processes), [p.name for p in seen.processes if not p.up]
    out = arena("top", "--once", "--interval", "1", "--state-dir", str(up.state), env=up.env)
    assert out.returncode == 0, out.stderr
    assert "down" not in out.stdout and "gateway" in out.stdout


def test_prometheus_on_the_config_arena_up_wrote_scrapes_the_gateway(up, tmp_path):
    config = up.state / "prometheus" / "prometheus.yml"
    with run_prometheus(config, tmp_path) as prometheus:
        expected = {r.name for r in topology.ROLES} | {"supervisor"}

        def all_up():
            active = active_targets(prometheus)
            return active if {t["labels"]["role"] for t in active if t["health"] == "up"} == expected else None

        active = wait_for(all_up, 30, "every target up")
        assert all(t["health"] == "up" for t in active), [(t["labels"], t["lastError"]) for t in active]
        [gateway] = query(prometheus, 'up{job="arenaflow", role="gateway"}')
        assert gateway["value"][1] == "1"


def test_no_key_in_a_log_or_the_state_dir(up):
    httpx.get(f"{up.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).raise_for_status()
    files = [p for p in up.state.rglob("*") if p.is_file() and p.suffix in (".log", ".json", ".yml", ".conf")]
    assert any(p.name == "gateway.log" for p in files)
    leaked = [str(p) for p in files if KEY in p.read_text(errors="replace")]
    assert not leaked, leaked
    assert KEY not in "".join(up.lines)
