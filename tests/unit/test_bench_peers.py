"""The peer comparison's pieces that need no built llama-server: `--peers`' options, each
target's command line, the llama.cpp source tree's extraction, the PSS sampler on real
processes, and the side-by-side table the report prints."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import compare, peers, procs, report, targets
from bench.stats import summarize

pytestmark = pytest.mark.timeout(60)


def test_peers_preset_sets_the_issue_run_and_explicit_options_win():
    args = compare.parse_args(["--peers"])
    assert args.model == peers.SMOLLM2
    assert args.targets.split(",") == ["arenaflow", "llama-server", "llama-server-bf16", "transformers-serve-cb"]
    assert (args.loads, args.sweep_lengths, args.dtype) == ("1,4,8,16,32", "64,256", "bfloat16")
    assert args.no_ceiling and args.no_engine and args.overhead_requests == 0
    assert compare.lengths_of(args) == [64, 256]

    quick = compare.parse_args(["--peers", "--loads", "1,8", "--sweep-lengths", "16", "--duration", "3"])
    assert (quick.loads, compare.lengths_of(quick), quick.duration) == ("1,8", [16], 3.0)
    assert quick.argv == ["--peers", "--loads", "1,8", "--sweep-lengths", "16", "--duration", "3"]


def test_compare_refuses_what_it_cannot_run(capsys):
    with pytest.raises(SystemExit):
        compare.parse_args([])  # no model, no --peers
    assert "--model is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.parse_args(["--model", "x", "--no-ceiling"])  # the overhead rows need the ceiling
    assert "--overhead-requests 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.parse_args(["--peers", "--targets", "llama-server,vllm"])
    assert "vllm" in capsys.readouterr().err
    assert compare.lengths_of(compare.parse_args(["--model", "x"])) == []  # the mix, as before


def _setup(tmp_path: Path, **kw) -> targets.Setup:
    return targets.Setup(tmp_path / "ckpt", "smollm2-135m", tmp_path, source=peers.SMOLLM2, **kw)


def test_llama_server_command_one_slot_per_user_every_core(tmp_path):
    setup = _setup(tmp_path, parallel=16, ctx_per_slot=384)
    cmd = targets.llama_server_command(setup, Path("/m/x.gguf"), 8123)
    assert cmd[0] == str(peers.SERVER)
    flags = {flag: value for flag, value in itertools.pairwise(cmd) if not value.startswith("--")}
    threads = str(os.cpu_count())
    assert flags["--model"] == "/m/x.gguf" and flags["--alias"] == "smollm2-135m"
    assert (flags["--host"], flags["--port"]) == ("127.0.0.1", "8123")
    assert (flags["--threads"], flags["--threads-batch"]) == (threads, threads)
    assert (flags["--parallel"], flags["--ctx-size"]) == ("16", str(16 * 384))
    assert "--cont-batching" in cmd
    pinned = targets.llama_server_command(_setup(tmp_path, torch_threads=1), Path("x.gguf"), 1)
    assert pinned[pinned.index("--threads") + 1] == "1"


def test_llama_server_says_how_to_build_or_convert(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "SERVER", tmp_path / "missing" / "llama-server")
    with pytest.raises(targets.NotRunnable, match=r"python -m bench\.peers build"):
        targets.prepare("llama-server", _setup(tmp_path))
    monkeypatch.setattr(peers, "SERVER", Path(sys.executable))  # "built"
    monkeypatch.setattr(peers, "MODELS_DIR", tmp_path / "models")
    with pytest.raises(targets.NotRunnable, match=r"python -m bench\.peers convert"):
        targets.prepare("llama-server-bf16", _setup(tmp_path))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "ckpt-bf16.gguf").write_bytes(b"GGUF")
    target = targets.prepare("llama-server-bf16", _setup(tmp_path))
    assert target.process.cmd[target.process.cmd.index("--model") + 1] == str(tmp_path / "models" / "ckpt-bf16.gguf")
    assert target.process.ready_url == f"{target.base_url}/health"
    checkpoint_only = targets.Setup(tmp_path / "ckpt", "m", tmp_path, source=str(tmp_path / "ckpt"))
    with pytest.raises(targets.NotRunnable, match="GGUF source"):
        targets.prepare("llama-server", checkpoint_only)


def test_arenaflow_target_is_plain_arena_up_with_a_deadline_that_fits(tmp_path):
    target = targets.prepare("arenaflow", _setup(tmp_path))
    up = target.process.cmd[target.process.cmd.index("up") :]
    assert up[0] == "up" and up[1::2] == ["--port", "--state-dir"]  # nothing but where: every default kept
    assert target.served_name == "smollm2-135m"
    assert dict(target.body_extra) == {"deadline_s": 120.0}
    with pytest.raises(targets.NotRunnable, match="by default"):
        targets.prepare("arenaflow", targets.Setup(tmp_path, "m", tmp_path, source="other.gguf"))


def test_transformers_cb_cache_sized_like_the_slots(tmp_path):
    flags = targets.cb_flags(_setup(tmp_path, parallel=32, ctx_per_slot=512))
    assert dict(zip(flags[0::2], flags[1::2], strict=True)) == {
        "--cb-block-size": "128",
        "--cb-num-blocks": str(32 * 4 + 4),
        "--cb-max-batch-tokens": "512",
    }


def test_pss_sampler_counts_a_server_and_its_children():
    script = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", script])
    try:
        while len(procs.tree_pss(server.pid)) < 2:  # the child is up
            time.sleep(0.05)
        with procs.PssSampler(server.pid, every_s=0.1) as memory:
            time.sleep(0.3)
        result = memory.result()
    finally:
        for child in procs._descendants(server.pid):
            child.kill()
        server.kill()
        server.wait()
    names = [p["name"] for p in result["pss_by_process"]]
    assert sorted(names) == sorted([Path(sys.executable).name, "sleep"])
    assert result["processes"] == 2 and result["samples"] >= 3
    assert result["pss_peak_bytes"] == sum(p["pss_bytes"] for p in result["pss_by_process"]) > 1_000_000
    assert procs.tree_pss(server.pid) == []  # gone: nothing to count


def _level(tokens: int, users: int, errors: int = 0) -> dict:
    """A level as `bench.loadgen.run_level` makes it: ten requests, one second of wall time."""
    ok = [{"status": "ok", "output_tokens": tokens, "latency_s": 0.5, "ttft_s": 0.018}] * (9 - errors)
    ok.append({"status": "ok", "output_tokens": tokens, "latency_s": 1.5, "ttft_s": 0.018})
    failed = [{"status": "error", "output_tokens": 0, "latency_s": None, "ttft_s": None}] * errors
    summary = summarize(ok + failed, wall_s=1.0)
    return {
        "load": float(users),
        "max_tokens": tokens,
        "load_label": f"{users} users x {tokens} tok",
        "summary": summary,
    }


def test_peer_table_users_down_targets_across_with_memory():
    memory = {"pss_peak_bytes": 350_000_000, "processes": 1, "pss_by_process": [{"name": "x", "pss_bytes": 1}]}
    results = {
        "targets": [
            {"name": "arenaflow", "status": "ok", "levels": [_level(64, 1), _level(64, 8, errors=2)]},
            {"name": "llama-server", "status": "ok", "levels": [_level(16, 1), _level(64, 1)], "memory": memory},
            {"name": "vllm", "status": "not runnable", "levels": []},
        ]
    }
    lines = report.peer_tables(results)
    head = ["| users | arenaflow | llama-server |", "|---|---|---|"]
    assert lines[:5] == [
        "16-token answers, closed loop:",
        "",
        *head,
        "| 1 | – | 160.0 tok/s, P50 0.5 s, P99 1.41 s, TTFT 0.018 s |",
    ]
    assert lines[5] == "| memory | – | PSS 0.35 GB over 1 processes |"
    assert lines[7:11] == [
        "64-token answers, closed loop:",
        "",
        *head,
    ]
    assert lines[11] == (
        "| 1 | 640.0 tok/s, P50 0.5 s, P99 1.41 s, TTFT 0.018 s | 640.0 tok/s, P50 0.5 s, P99 1.41 s, TTFT 0.018 s |"
    )
    assert lines[12] == "| 8 | 512.0 tok/s, P50 0.5 s, P99 1.43 s, TTFT 0.018 s, 2 errors, 0 429s of 10 | – |"
    assert lines[13] == "| memory | – | PSS 0.35 GB over 1 processes |"
    assert "## Side by side" in report.markdown(results)
    assert report.peer_tables({"targets": [{"name": "naive", "status": "ok", "levels": []}]}) == []
