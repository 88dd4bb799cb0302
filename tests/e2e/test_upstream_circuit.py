"""An upstream that goes down and comes back: a real `llama-server` behind the proxy of
tests/upstream_proxy.py, which can refuse every connection, served by `arena up --models-config` as a
`backend: upstream` model beside the local stories-260k. Refused connections open the
circuit: the gateway answers 503 model_unavailable at once and the arena no longer pairs
the model; once the upstream answers again the worker's half-open probe closes it and
requests are served again; the audit is clean."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.arena_up import ArenaUp, arena
from tests.e2e.test_upstream import KEY, upstream  # noqa: F401 - the fixture: a real llama-server
from tests.upstream_proxy import FaultyProxy, proxied_stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

MODEL = "smollm2-flaky"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def proxied(upstream: str, tmp_path_factory) -> Iterator[tuple[ArenaUp, FaultyProxy]]:  # noqa: F811
    upstream_entry = "{base_url: '{url}', model: smollm2, api_key_env: TEAM_KEY}"
    entry = f"{{name: {MODEL}, backend: upstream, upstream: {upstream_entry}}}"
    with proxied_stack(upstream, tmp_path_factory.mktemp("circuit"), [entry], KEY) as stack:
        yield stack


def until(check, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if (found := check()) is not None:
            return found
        time.sleep(0.5)
    pytest.fail(f"not within {timeout_s} s: {what}")


def test_a_failing_upstream_opens_the_circuit_and_a_probe_closes_it(proxied):
    up, proxy = proxied
    with httpx.Client(base_url=up.url, timeout=60) as client:
        assert client.post("/v1/chat/completions", json=BODY).status_code == 200

        proxy.refusing = True
        failed = client.post("/v1/chat/completions", json=BODY)  # tried again within its deadline, then failed
        assert failed.status_code in (500, 503), failed.text
        assert "upstream" in failed.json()["error"]["message"]

        def refused_at_once():
            t0 = time.monotonic()
            r = client.post("/v1/chat/completions", json=BODY)
            fast = time.monotonic() - t0 < 2.0
            refused = r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
            assert refused or r.status_code == 500, r.text  # refused by the worker, or the gateway
            return r if refused and fast and r.headers.get("retry-after") else None

        # The worker refuses it at once first; then its heartbeat tells the gateway, which
        # refuses it before queueing it, saying when to ask again.
        refused = until(refused_at_once, 60, "503 model_unavailable from the gateway, with Retry-After")
        assert MODEL in refused.json()["error"]["message"]
        battle = client.post("/arena/battles")  # one model left to pair
        assert battle.status_code == 503 and battle.json()["error"]["code"] == "not_enough_models", battle.text

        proxy.refusing = False
        until(
            lambda: True if client.post("/v1/chat/completions", json=BODY).status_code == 200 else None,
            90,
            "served again after the upstream came back",
        )
        assert client.post("/arena/battles").status_code == 201  # the two models pair again
    audit = arena("audit", "--since", "1h", "--state-dir", str(up.state), "--json", env=up.env)
    assert audit.returncode == 0 and json.loads(audit.stdout)["ok"], audit.stdout


def test_a_busy_upstream_is_waited_out_and_a_broken_completion_continued(proxied):
    up, proxy = proxied
    with httpx.Client(base_url=up.url, timeout=60) as client:
        proxy.fail_next("busy", "busy")  # 429 with Retry-After: 1, twice, then served
        r = client.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 200 and not proxy.faults, r.text

        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "stream": True}
        whole = client.post("/v1/completions", json={**body, "stream": False}).json()["choices"][0]["text"]
        proxy.fail_next("drop")  # a few events, then the connection is cut
        with client.stream("POST", "/v1/completions", json=body) as s:
            assert s.status_code == 200
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert not proxy.faults and not any("error" in e for e in events), events
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        # Continued from the text it had, never repeating it: the answer begins as the
        # unbroken one does, and its beginning is in it once.
        assert text.strip() and whole.startswith(text[:8]) and text.count(text[:12]) == 1, (text, whole)
    audit = arena("audit", "--since", "1h", "--state-dir", str(up.state), "--json", env=up.env)
    assert audit.returncode == 0 and json.loads(audit.stdout)["ok"], audit.stdout
