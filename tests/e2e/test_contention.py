"""`arena up` beside a CPU hog (issue 49), as a user on a busy machine meets it: a step
profile measured while the CPU was busy must not lock the model out once the machine is
quiet again, and while the hog runs, every turn is answered in time or refused at once,
never admitted and then cut at its deadline.

The hog is `stress-ng --cpu 8` on 2 cores (Debian's stress-ng, `scripts/test-setup.sh`); the stack is
`arena up`'s defaults, with an empty ARENA_STEP_FIGURES_DIR so that its start-up profile
really runs beside the hog. Each test prints its timeline."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time

import httpx
import openai
import pytest

from consumers.inference.runners.process import ENGINE_NICE
from events.models import DEFAULT_MAX_TOKENS
from tests.arena_up import ArenaUp

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: The README's "A first request", as a newcomer sends it (max_tokens omitted: 64).
README_REQUEST = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0}
DEADLINE_S = 15.0  # the default deadline: no request here names one
#: After the hog ends, the README's request is answered within this long (issue 49).
ANSWERED_WITHIN_S = 10.0
#: Nice levels the hog runs ahead of the engine processes.
HOG_AHEAD = 5


class Hog:
    """`stress-ng --cpu N`, 4 spinning workers a core (8 on 2 cores), in a process group of
    its own, ahead of the engine processes where the OS allows it (a job more urgent than
    the stack, or `arena up` run niced): the engines run at ENGINE_NICE, and beside a hog
    at nice 0 they kept most of their share (SmolLM2's profile: a full batch 0.41 s a step,
    as on a quiet machine; 5 levels ahead, 1.74 s)."""

    def __init__(self) -> None:
        binary = shutil.which("stress-ng")
        assert binary, "stress-ng is missing: scripts/test-setup.sh installs it (apt-get install stress-ng)"
        self.command = [
            "nice",
            "-n",
            str(ENGINE_NICE - HOG_AHEAD),
            binary,
            "--cpu",
            str(4 * len(os.sched_getaffinity(0))),
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen(
                [*self.command, "--quiet"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )

    def stop(self) -> float:
        """Stop it (its workers with it); when it ended (time.monotonic())."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
            self.proc = None
        return time.monotonic()


@pytest.fixture(scope="module")
def hog():
    h = Hog()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, hog):
    """`arena up` started beside the hog, its step profile measured there."""
    hog.start()
    figures = tmp_path_factory.mktemp("step-figures")
    started = time.monotonic()
    up = ArenaUp(tmp_path_factory.mktemp("contention"), env={"ARENA_STEP_FIGURES_DIR": str(figures)})
    print(f"arena up ready beside the hog in {time.monotonic() - started:.1f} s")
    yield up
    up.stop()


def readme_request(url: str) -> tuple[int, dict]:
    r = httpx.post(url + "/v1/chat/completions", json=README_REQUEST, timeout=60)
    return r.status_code, r.json()


def first_answer(url: str, since: float) -> None:
    """Send the README's request every second from `since` (time.monotonic()) until one is
    answered, and check it was within ANSWERED_WITHIN_S of it, whole; the refusals before
    it are the ones a figure not yet followed gives (400 or 429 at once), nothing else."""
    timeline, answer = [], None
    while answer is None and time.monotonic() - since < ANSWERED_WITHIN_S:
        sent = time.monotonic()
        status, body = readme_request(url)
        timeline.append((round(sent - since, 1), round(time.monotonic() - since, 1), status, str(body)[:160]))
        if status == 200:
            answer = (time.monotonic() - since, body)
        else:
            assert (status, body["error"]["code"]) in ((400, "deadline_too_short"), (429, "overloaded")), timeline
            time.sleep(max(0.0, 1.0 - (time.monotonic() - sent)))
    print("\n".join(f"sent +{s} s, back +{b} s: {code} {text}" for s, b, code, text in timeline))
    assert answer is not None and answer[0] <= ANSWERED_WITHIN_S, timeline
    choice = answer[1]["choices"][0]
    assert choice["message"]["content"].strip() and choice["finish_reason"] in ("stop", "length"), answer


@pytest.mark.timeout(600)
def test_the_first_request_is_answered_within_10_s_of_a_hog_that_ran_through_start_up(stack, hog):
    """The lockout: a profile measured beside the hog said a token took seconds, every
    request was refused with 400 deadline_too_short, and refused requests run nothing, so
    the figure never corrected (minutes of refusals, also after a restart). The README's
    request, sent every second from the hog's end, is answered within 10 s of it."""
    hog.start()  # running since the stack started, unless another test stopped it
    status, body = readme_request(stack.url)
    print(f"beside the hog: {status} {str(body)[:200]}")
    first_answer(stack.url, hog.stop())


class Turns:
    """What each client got, from threads: admitted turns' times and ends, refusals."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.answered: list[tuple[str, float, str]] = []  # (who, seconds, finish_reason)
        self.cut: list[tuple[str, float, str]] = []  # admitted, then ended by the deadline
        self.refused: list[tuple[str, int, str]] = []  # (who, status, code)
        self.other: list[tuple[str, str]] = []

    def add(self, kind: str, entry: tuple) -> None:
        with self.lock:
            getattr(self, kind).append(entry)


def chat_user(url: str, model: str, max_tokens: int | None, until: float, turns: Turns) -> None:
    """A user sending turns one after the other (httpx, non-streamed)."""
    who = f"{model}/{max_tokens}"
    body = {**README_REQUEST, "model": model} | ({"max_tokens": max_tokens} if max_tokens else {})
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < until:
            started = time.monotonic()
            r = client.post(url + "/v1/chat/completions", json=body)
            took = time.monotonic() - started
            data = r.json()
            if r.status_code == 200:
                reason = data["choices"][0]["finish_reason"]
                turns.add("answered" if reason in ("stop", "length") else "cut", (who, took, reason))
            elif r.status_code in (400, 429):
                turns.add("refused", (who, r.status_code, data["error"]["code"]))
                time.sleep(float(r.headers.get("retry-after", 1)) if r.status_code == 429 else 1.0)
            elif r.status_code == 504:
                turns.add("cut", (who, took, data["error"]["code"]))
            else:
                turns.add("other", (who, f"{r.status_code} {r.text[:200]}"))


def sdk_user(url: str, until: float, turns: Turns) -> None:
    """A user of the official openai client, its retries as they are (429s retried after
    their Retry-After): what such a user sees."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=60)
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            done = client.chat.completions.create(model="smollm2-135m", **README_REQUEST)
            reason = done.choices[0].finish_reason
            turns.add(
                "answered" if reason in ("stop", "length") else "cut", ("sdk", time.monotonic() - started, reason)
            )
        except openai.APIStatusError as exc:
            code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
            if exc.status_code == 504:
                turns.add("cut", ("sdk", time.monotonic() - started, str(code)))
            else:
                turns.add("refused", ("sdk", exc.status_code, str(code)))
                time.sleep(1.0)


def battle_turns(url: str, until: float, turns: Turns) -> None:
    """Arena battle turns, both sides streamed: a side cut at its deadline is a cut turn."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while time.monotonic() < until:
            bid = client.post("/arena/battles").json()["battle_id"]
            started = time.monotonic()
            with client.stream("POST", f"/arena/battles/{bid}/turns", json={"prompt": "A cat", "max_tokens": 24}) as r:
                body = "".join(r.iter_text())
            took = time.monotonic() - started
            if r.status_code != 200:
                turns.add("refused", ("battle", r.status_code, json.loads(body)["error"]["code"]))
                time.sleep(1.0)
                continue
            frames = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
            ends = [f for f in frames if f["finish_reason"]]
            codes = [f["error"]["code"] for f in ends if "error" in f]
            if "deadline_exceeded" in codes:
                turns.add("cut", ("battle", took, ",".join(codes)))
            elif codes:
                turns.add("refused", ("battle", 200, ",".join(codes)))
            else:
                turns.add("answered", ("battle", took, ",".join(f["finish_reason"] for f in ends)))


#: How long the load runs beside the hog, and how long the hog runs before it: an idle
#: engine probes every 2 s while the CPU is contended (consumers/inference/runners/probes.py).
LOAD_S = 60.0
SETTLE_S = 5.0


@pytest.mark.timeout(600)
def test_with_a_hog_running_every_turn_is_answered_in_time_or_refused_at_once(stack, hog):
    """A modest load beside the hog (a few users on the default model, 64-token and short
    answers, a user of the small model, one of the openai client, arena battle turns with
    both models stepping together): refusals are allowed, an admitted turn that comes back
    late or cut by its deadline is not."""
    hog.start()
    time.sleep(SETTLE_S)
    turns = Turns()
    until = time.monotonic() + LOAD_S
    users = [
        threading.Thread(target=chat_user, args=(stack.url, "smollm2-135m", None, until, turns)),
        threading.Thread(target=chat_user, args=(stack.url, "smollm2-135m", 8, until, turns)),
        threading.Thread(target=chat_user, args=(stack.url, "stories-260k", 64, until, turns)),
        threading.Thread(target=sdk_user, args=(stack.url, until, turns)),
        threading.Thread(target=battle_turns, args=(stack.url, until, turns)),
    ]
    for u in users:
        u.start()
    for u in users:
        u.join(LOAD_S + 120)
    hog.stop()
    late = [t for t in turns.answered if t[1] > DEADLINE_S and t[0] != "sdk"]  # the SDK's time counts its retries
    print(f"answered {len(turns.answered)}, refused {len(turns.refused)}, cut {len(turns.cut)}, late {len(late)}")
    for who in sorted({t[0] for t in turns.answered + turns.cut} | {t[0] for t in turns.refused}):
        times = sorted(t[1] for t in turns.answered if t[0] == who)
        refusals = [f"{s} {c}" for w, s, c in turns.refused if w == who]
        print(f"  {who}: answered {len(times)} (slowest {times[-1] if times else 0:.1f} s), refused {refusals}")
    assert not turns.cut and not late and not turns.other, (turns.cut, late, turns.other)
    assert turns.answered, "nothing was admitted: the load asserts nothing"


#: What a hog made of the kept figures in the issue's report: a token 23x slower (2,172 ms
#: for SmolLM2's ~95); at least enough here that the README's request would take 4x its
#: deadline (a fast CPU's steps times 20 might still fit).
HOGGED = 20.0


@pytest.mark.timeout(600)
def test_figures_kept_beside_a_hog_do_not_lock_the_next_start_out(tmp_path):
    """An engine starting within 15 minutes of another takes its kept figures instead of
    profiling (ARENA_STEP_FIGURES_DIR): kept beside a hog, they refused the README's request
    after a restart too. The figures of a first `arena up` are made what a hog would have
    made them (every step 20x or more), and a second one started on them, on a machine
    without the hog, answers the README's request within 10 s of its start."""
    figures = tmp_path / "step-figures"
    first = ArenaUp(tmp_path / "first", env={"ARENA_STEP_FIGURES_DIR": str(figures)})
    first.stop()
    kept = sorted(figures.glob("*.json"))
    assert kept, "the first stack kept no figures"
    for path in kept:
        data = json.loads(path.read_text())
        hogged = max(HOGGED, 4 * DEADLINE_S / (DEFAULT_MAX_TOKENS * statistics.median(data["_alone_idle"])))
        for name in ("_small", "_full", "_alone", "_alone_idle"):
            data[name] = [x * hogged for x in data[name]]
        path.write_text(json.dumps(data))
    again = ArenaUp(tmp_path / "again", env={"ARENA_STEP_FIGURES_DIR": str(figures)})
    try:
        log = (again.state / "logs" / "inference-0.log").read_text()
        assert "step profile skipped" in log, "the second stack profiled instead of taking the kept figures"
        first_answer(again.url, time.monotonic())
    finally:
        again.stop()
