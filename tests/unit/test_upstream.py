"""The upstream backend's pure parts: the models config's `backend: upstream` entry, the
key read from its variable or file, the OpenAI request a request becomes, the fields an
entry refuses, and the streamed log probabilities. The backend itself runs against a real
llama-server in tests/e2e/test_upstream.py."""

from __future__ import annotations

import pytest

from consumers.inference.engine.logprobs import Pieces, spelled, speller
from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.engine_io import GenRequest, StepOutput, TextPrompt
from consumers.inference.errors import PermanentError, Unsupported
from consumers.inference.model_loading import ModelSpec, load_models_config, upstream_model
from consumers.inference.streamed import StreamedEngine
from consumers.inference.upstream.circuit import Circuit
from consumers.inference.upstream.engine import check_served, delta_logprobs, request_body, retry_after
from consumers.inference.upstream.options import UpstreamOptions

pytestmark = pytest.mark.timeout(30)

ENTRY = {"base_url": "http://gpu-1:8000/v1/", "model": "team/model-7b", "api_key_env": "TEAM_KEY"}


def test_an_entry_needs_no_path_and_shows_its_url(tmp_path):
    config = tmp_path / "models.yaml"
    config.write_text(
        "models:\n"
        "  - {name: up, backend: upstream, upstream: {base_url: 'http://gpu-1:8000/v1', model: m}}\n"
        "  - {name: up-cold, base: up, temperature: 0.2}\n"
    )
    up, variant = load_models_config(str(config), tmp_path)
    assert up.path == "http://gpu-1:8000/v1" and up.upstream is not None and up.upstream.model == "m"
    assert variant.backend == "upstream" and variant.upstream == up.upstream


def test_an_entry_is_checked_with_what_to_fix():
    with pytest.raises(ValueError, match="needs an upstream: block"):
        ModelSpec(name="u", path="x", backend="upstream")
    with pytest.raises(ValueError, match="api_key_env or api_key_file, not both"):
        UpstreamOptions(**ENTRY, api_key_file="/k")
    with pytest.raises(ValueError, match="not in headers: Authorization"):
        UpstreamOptions(**ENTRY, headers={"authorization": "Bearer x"})
    with pytest.raises(ValueError, match="base_url must be an http"):
        UpstreamOptions(base_url="gpu-1:8000", model="m")
    assert UpstreamOptions(**ENTRY).base_url == "http://gpu-1:8000/v1"


def test_the_key_comes_from_its_variable_or_file_and_errors_never_show_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TEAM_KEY", raising=False)
    with pytest.raises(PermanentError, match="TEAM_KEY is not set"):
        UpstreamOptions(**ENTRY).api_key()
    monkeypatch.setenv("TEAM_KEY", "sk-secret-1\n")
    assert UpstreamOptions(**ENTRY).api_key() == "sk-secret-1"
    key = tmp_path / "key"
    key.write_text("sk-secret-2\n")
    assert UpstreamOptions(base_url="http://h/v1", model="m", api_key_file=str(key)).api_key() == "sk-secret-2"
    key.write_text("")
    with pytest.raises(PermanentError, match="is empty"):
        UpstreamOptions(base_url="http://h/v1", model="m", api_key_file=str(key)).api_key()
    assert "sk-secret" not in UpstreamOptions(**ENTRY).model_dump_json()


def chat_request(**params) -> GenRequest:
    prompt = TextPrompt(messages=[{"role": "user", "content": "Hi"}])
    return GenRequest("r", [], SamplingParams(**params), text_prompt=prompt)


def test_a_request_maps_to_the_openai_fields():
    options = UpstreamOptions(**ENTRY)
    req = chat_request(temperature=0.5, top_p=0.9, max_tokens=7, stop=("\n",), seed=3, presence_penalty=0.5, logprobs=2)
    body = request_body(options, req, "")
    assert body["model"] == "team/model-7b" and body["messages"] == [{"role": "user", "content": "Hi"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["stop"], body["seed"]) == (
        7,
        0.5,
        0.9,
        ["\n"],
        3,
    )
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.5, 0.0)
    assert (body["logprobs"], body["top_logprobs"], body["stream"]) == (True, 2, True)
    assert body["stream_options"] == {"include_usage": True}
    text = GenRequest("r", [], SamplingParams(logprobs=0), text_prompt=TextPrompt(text="Once"))
    body = request_body(options, text, " upon")
    assert body["prompt"] == "Once upon" and body["logprobs"] == 1 and "messages" not in body


def test_what_the_entry_says_it_lacks_is_refused_naming_the_field():
    options = UpstreamOptions(**ENTRY, unsupported=("seed", "logprobs"), endpoints=("chat",))
    check_served(options, "up", chat_request(temperature=0.3))
    with pytest.raises(Unsupported, match=r"^seed: model 'up' cannot serve it"):
        check_served(options, "up", chat_request(seed=1))
    with pytest.raises(Unsupported, match=r"^logprobs:"):
        check_served(options, "up", chat_request(logprobs=0))
    text = GenRequest("r", [], SamplingParams(), text_prompt=TextPrompt(text="Once"))
    with pytest.raises(Unsupported, match=r"^prompt: .* serves chat only"):
        check_served(options, "up", text)
    resumed = GenRequest("r", [], SamplingParams(), text_prompt=TextPrompt(messages=[], resumed="Hel"))
    with pytest.raises(PermanentError, match="cannot continue a chat answer") as refused:
        check_served(options, "up", resumed)
    assert not isinstance(refused.value, Unsupported)  # not the client's 400: its worker died


def test_a_chat_answer_is_continued_as_a_final_assistant_message_where_the_entry_says_so():
    prompt = TextPrompt(messages=[{"role": "user", "content": "Hi"}], resumed="Hello the")
    resumed = GenRequest("r", [], SamplingParams(), text_prompt=prompt)
    check_served(UpstreamOptions(**ENTRY, continue_chat=True), "up", resumed)  # not refused: it continues
    body = request_body(UpstreamOptions(**ENTRY, continue_chat=True), resumed, "Hello the")
    assert body["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello the"}]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    fresh = request_body(UpstreamOptions(**ENTRY, continue_chat=True), resumed, "")
    assert fresh["messages"] == [{"role": "user", "content": "Hi"}] and "continue_final_message" not in fresh


def test_streamed_log_probabilities_are_spelled_as_sent():
    pieces = Pieces()
    chat = {
        "logprobs": {
            "content": [
                {
                    "token": " a",
                    "logprob": -0.5,
                    "top_logprobs": [{"token": " a", "logprob": -0.5}, {"token": " b", "logprob": -1.5}],
                }
            ]
        }
    }
    [lp] = delta_logprobs(chat, pieces, 1) or []
    [entry] = spelled([lp], speller(pieces))
    assert (entry.token, entry.logprob, entry.bytes) == (" a", -0.5, tuple(b" a"))
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(" a", -0.5)]
    text = {"logprobs": {"tokens": ["é"], "token_logprobs": [-0.25], "top_logprobs": [{"é": -0.25, "e": -2.0}]}}
    [lp] = delta_logprobs(text, pieces, 2) or []
    assert pieces(lp.token_id) == ("é", tuple("é".encode())) and len(lp.top) == 2
    assert delta_logprobs({"text": "x"}, pieces, 1) is None


def test_retry_after_in_seconds_else_the_backoff():
    assert retry_after("2", 0) == 2.0
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 0) == retry_after(None, 0) > 0


def test_the_circuit_opens_after_failures_and_a_half_open_probe_closes_it():
    now = [0.0]
    circuit = Circuit(failures_to_open=3, cooldown_s=5, max_cooldown_s=12, clock=lambda: now[0])
    for _ in range(2):
        circuit.failed("refused")
    circuit.succeeded()  # a success between: the count starts again
    for _ in range(3):
        assert circuit.allow()
        circuit.failed("refused")
    assert circuit.open and not circuit.allow() and circuit.retry_in() == 5
    now[0] = 5.0
    assert circuit.allow() and not circuit.allow()  # one probe, the rest refused meanwhile
    circuit.failed("refused")  # the probe failed: open for twice as long
    now[0] = 14.0
    assert not circuit.allow()
    now[0] = 15.0
    assert circuit.allow()
    circuit.released()  # the probe said nothing (cancelled): another may go
    assert circuit.allow()
    circuit.succeeded()
    assert not circuit.open and circuit.allow() and circuit.allow()


def test_a_streams_last_output_is_work_until_a_step_takes_it(tmp_path):
    """A stream that fails at once (a 500) leaves no stream running, only its output: the
    runner must step it out, not idle with it queued until the next request comes."""
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - {name: up, backend: upstream, upstream: {base_url: 'http://h/v1', model: m}}\n")
    [spec] = load_models_config(str(config), tmp_path)
    engine = StreamedEngine(upstream_model(spec, 1), 1, "test-streams")
    try:
        assert not engine.stats().has_work()
        engine._outputs.put(StepOutput.ended(GenRequest("r", [], SamplingParams()), "error"))
        assert engine.stats().has_work()
        [out] = engine.step()
        assert out.finished and out.finish_reason == "error" and not engine.stats().has_work()
    finally:
        engine.close()
