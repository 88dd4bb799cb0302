"""The arena web page in a real headless browser (chromium), against a real stack:
a whole battle played through the page, and the leaderboard page. Screenshots go to a
temporary directory; `ARENA_SCREENSHOTS=docs/img` refreshes the README's."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.settings import GatewaySettings
from tests.arena_up import ArenaUp
from tests.conftest import REPO
from tests.e2e.test_arena_battles import MODELS, START_S, arena_cmd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEAK = re.compile(r"stories[\s_\-./:]*260k|creative|focused", re.IGNORECASE)
#: The generated text in the stream's frames (`delta.content`), which is the model's own words.
GENERATED = re.compile(r'"content":\s*"(?:[^"\\]|\\.)*"')


@pytest.fixture(scope="module")
def img(tmp_path_factory) -> Path:
    """Where screenshots go: a temporary directory, so a test run leaves the source tree alone."""
    where = os.environ.get("ARENA_SCREENSHOTS")
    return (REPO / where) if where else tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def arena(module_stack_factory):
    return module_stack_factory(ARENA_MODELS_CONFIG=REPO / "configs" / "stories-arena.yaml").start(timeout=START_S)


def _body(response) -> str:
    """A response's text, or "" for one whose body the browser no longer holds (raising
    in the page's event handler broke the next test's page once)."""
    from playwright.sync_api import Error

    try:
        return response.text() if response.ok else ""
    except Error:
        return ""


def play_round(page, prompt: str) -> None:
    page.fill("#prompt", prompt)
    page.click("#send")
    page.wait_for_selector(".votes button[data-choice='a']:not([disabled])", timeout=60_000)


def test_a_whole_battle_through_the_page(arena, browser, img):
    page = browser.new_page(viewport={"width": 1100, "height": 760})
    received: list[str] = []
    page.on("response", lambda r: received.append(f"{r.url} {r.headers} {_body(r)}"))
    page.goto(f"{arena.url}/arena")
    page.wait_for_function("document.querySelector('#status').textContent.startsWith('New battle')")
    play_round(page, "Once upon a time")
    play_round(page, "Then the little dog")
    for side in ("a", "b"):
        answers = page.locator(f"#pane-{side} .answer").all_inner_texts()
        assert len(answers) == 2 and all(a.strip() for a in answers)
    assert page.inner_text("#pane-a .name") == "Model A"
    page.screenshot(path=str(img / "arena-battle.png"), full_page=True)
    # The answers themselves are the model's free text (a story may say "focused"): only
    # what else reached the browser is searched for a model's name.
    page_text = page.content()
    for answer in page.locator(".answer").all_inner_texts():
        page_text = page_text.replace(answer, "")
    before_vote = page_text + GENERATED.sub('"content": ""', "".join(received))
    leak = LEAK.search(before_vote)
    context = before_vote[max(0, leak.start() - 200) : leak.end() + 200] if leak else ""
    assert leak is None, f"a model name reached the browser before the vote: ...{context}..."

    page.click(".votes button[data-choice='a']")
    page.wait_for_selector("#reveal:not([hidden])")
    reveal = page.inner_text("#reveal")
    assert LEAK.search(reveal) and "Your vote counts" in reveal
    assert "winner" in page.get_attribute("#pane-a", "class")
    page.screenshot(path=str(img / "arena-reveal.png"), full_page=True)

    page.click("#new-round")
    page.wait_for_function("document.querySelector('#status').textContent.startsWith('New battle')")
    assert page.inner_text("#pane-a .text") == "" and page.inner_text("#pane-a .name") == "Model A"
    play_round(page, "A cat")
    page.click(".votes button[data-choice='tie']")
    page.wait_for_selector("#reveal:not([hidden])")


def test_leaderboard_page_and_phone_width(arena, browser, img):
    phone = browser.new_page(viewport={"width": 390, "height": 844})
    phone.goto(f"{arena.url}/arena/board")
    phone.wait_for_selector("#rows tr", timeout=20_000)
    rows = phone.locator("#rows tr")
    assert rows.count() >= 2
    assert phone.locator("#rows .bar span").count() == rows.count()
    # Few votes yet: every row is provisional, marked, and the summary says from how many votes it is not.
    assert phone.locator("#rows .provisional").count() == rows.count()
    assert "fewer than 30 votes" in phone.inner_text("#summary")
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    phone.wait_for_selector("#history-rows tr", timeout=20_000)
    phone.screenshot(path=str(img / "arena-leaderboard-phone.png"), full_page=True)
    phone.goto(f"{arena.url}/arena")
    phone.wait_for_function("document.querySelector('#status').textContent.startsWith('New battle')")
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    # (After the battle page above, which needs two models.) One model withdrawn by the operator,
    # one taken off the inference process: both stay listed.
    entered = [m["model"] for m in httpx.get(f"{arena.url}/arena/history").json()["models"]]
    # A variant is taken off: a base of variants and the default model cannot be removed.
    removed = next(m for m in entered if m != MODELS[0])
    withdrawn = next(m for m in entered if m != removed)
    done = arena_cmd(arena, "models", "withdraw", "--name", withdrawn, "--reason", "private test over")
    assert done.returncode == 0, done.stderr
    assert arena_cmd(arena, "models", "remove", "--name", removed).returncode == 0
    wide = browser.new_page(viewport={"width": 1100, "height": 500})
    wide.goto(f"{arena.url}/arena/board")
    wide.wait_for_selector("#rows tr", timeout=20_000)
    wide.wait_for_selector(f"#history-rows tr[data-model='{removed}'] .inactive-mark", timeout=20_000)
    wide.wait_for_selector(f"#history-rows tr[data-model='{withdrawn}'] .withdrawn-mark", timeout=20_000)
    entered = [m["model"] for m in httpx.get(f"{arena.url}/arena/history").json()["models"]]
    wide.screenshot(path=str(img / "arena-leaderboard.png"), full_page=True)
    # The history: every model that entered, the withdrawn one marked with its reason, the one
    # no longer served marked too, and the variants per owner.
    history = wide.locator("#history-rows tr")
    assert history.count() == len(entered)
    mark = wide.locator(f"#history-rows tr[data-model='{withdrawn}'].withdrawn .withdrawn-mark")
    assert mark.inner_text() == "withdrawn" and "private test over" in mark.get_attribute("title")
    assert wide.locator("#history-rows .withdrawn-mark").count() == 1
    assert f"karpathy {len(entered)} (1 withdrawn)" in wide.inner_text("#owners")
    wide.locator("#history-section").screenshot(path=str(img / "arena-history.png"))
    # The style-controlled board, with its coefficients, then one category's board.
    wide.select_option("#view", "style")
    wide.wait_for_function("document.querySelector('#coefficients').textContent.includes('length')")
    wide.wait_for_selector("#rows tr")
    assert wide.locator("#rows tr").count() >= 2 and "with style counts" in wide.inner_text("#summary")
    wide.screenshot(path=str(img / "arena-leaderboard-style.png"), full_page=True)
    wide.wait_for_selector("#categories option[value='category:english']", state="attached")
    wide.select_option("#view", "category:english")
    wide.wait_for_function("document.querySelector('#summary').textContent.includes('in english')")
    assert wide.locator("#rows tr").count() >= 2 and wide.is_hidden("#coefficients")


# ---- a turn refused, a turn cut: what a person sees ------------------------------------

PROMPT = "Once upon a time there was a lighthouse keeper who collected lost things"
#: What the API says to programs and the page must not show a person: the gateway's
#: refusal, the stream's failure messages, the neutral names and the endpoint hints.
RAW = re.compile(
    r"requests queued|retry later|generation ended|\[model\]|model_[ab]|/arena/battles|deadline_s|max_tokens"
)


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[ArenaUp]:
    """`arena up` as a user runs it (the stories arena, the default deadline), with the
    backstop at one request in flight per model, so a busy model refuses a turn at once."""
    stack = ArenaUp(
        tmp_path_factory.mktemp("arena-up"),
        "--models-config",
        str(REPO / "configs" / "stories-arena.yaml"),
        "--default-model",
        MODELS[0],
        ready_s=START_S,
        env={"ARENA_MAX_QUEUE_PER_MODEL": "1"},
    )
    yield stack
    stack.stop()


def every_model_busy(url: str) -> list[threading.Thread]:
    """One streamed request per model, each in flight once its answer's head is here
    (a stalled engine holds them): every model is at the backstop. The threads end with
    the answers."""
    started = threading.Barrier(len(MODELS) + 1, timeout=30)

    def hold(model: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "deadline_s": 60}, timeout=90) as r:
            assert r.status_code == 200, r.read()
            started.wait()
            r.read()

    threads = [threading.Thread(target=hold, args=(m,), daemon=True) for m in MODELS]
    for t in threads:
        t.start()
    started.wait()
    return threads


def told_plainly(page, width: int, shot: Path) -> str:
    """The page's state after a turn that did not finish: a short message, the prompt
    still in its box, a retry, no vote buttons, nothing wider than the window. The message."""
    page.wait_for_selector("#notice:not([hidden])", timeout=30_000)
    message = page.inner_text("#notice-text")
    body = page.inner_text("body")
    assert 0 < len(message) <= 160 and not RAW.search(body), f"{message!r} / {RAW.search(body)} in {body!r}"
    assert page.input_value("#prompt") == PROMPT
    assert page.is_visible("#retry") and page.is_enabled("#retry")
    assert page.is_hidden(".votes") and page.locator(".votes button:visible").count() == 0
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    page.screenshot(path=str(shot), full_page=True)
    return message


def retried(page) -> None:
    """The retry sends the kept prompt again and both models answer it."""
    page.click("#retry")
    page.wait_for_selector(".votes button[data-choice='a']:not([disabled])", timeout=60_000)
    assert page.is_hidden("#notice") and page.input_value("#prompt") == ""
    assert [t.strip() for t in page.locator("#pane-a .you").all_inner_texts()] == [PROMPT]
    assert all(a.strip() for a in page.locator(".answer").all_inner_texts())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("width", [1280, 390])
def test_a_refused_and_a_cut_turn_speak_to_a_person(up, browser, img, width):
    """(a) Every model busy: the turn is refused (429 at the backstop, one side refused
    and the other never run); (b) the engines stall past the default deadline: both
    sides are cut at it. Neither is offered for a vote, the server refuses one too, and
    the page says what happened in a sentence, keeps the prompt and retries it."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    page.goto(f"{up.url}/arena")
    page.wait_for_function("document.querySelector('#status').textContent.startsWith('New battle')")

    page.fill("#prompt", PROMPT)
    with up.engines_stalled():
        held = every_model_busy(up.url)
        page.click("#send")
        refused = told_plainly(page, width, img / f"arena-refused-{width}.png")
    for t in held:
        t.join(30)
    assert "busy" in refused and page.locator(".answer").count() == 0  # nothing ran
    retried(page)

    page.click("#new-round")
    page.wait_for_function("document.querySelector('#status').textContent.startsWith('New battle')")
    page.fill("#prompt", PROMPT)
    deadline_s = GatewaySettings.model_fields["deadline_s"].default
    with up.engines_stalled():
        page.click("#send")
        time.sleep(deadline_s + 0.5)  # the engines step again once the turn's deadline has passed
    told_plainly(page, width, img / f"arena-cut-{width}.png")
    notes = page.locator(".ended").all_inner_texts()
    assert len(notes) == 2 and any("ran out of time" in n for n in notes), notes
    battle_id = page.evaluate("battle.battle_id")
    vote = httpx.post(f"{up.url}/arena/battles/{battle_id}/vote", json={"choice": "a"}, timeout=30)
    assert vote.status_code == 409 and vote.json()["error"]["code"] == "turn_incomplete", vote.text
    retried(page)
    assert page.locator(".ended").count() == 0  # the cut turn made way for its retry
    page.click(".votes button[data-choice='b']")
    page.wait_for_selector("#reveal:not([hidden])")
    assert "Your vote counts" in page.inner_text("#reveal")
