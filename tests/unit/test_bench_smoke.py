"""Smoke tests that keep the benchmark harness working, on the real stories260K model.

The naive server runs as a subprocess on a free port, as `bench.compare` starts it;
loadgen and the overhead client talk to it over HTTP; the ceiling runs in-process.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from bench import ceiling, compare, hf, overhead, prefix_ttft
from bench.client import check_local
from bench.loadgen import run_level
from bench.procs import ServerProcess
from bench.report import write_report
from bench.stats import percentile
from bench.workload import LengthMix, Workload, fixed_requests
from runtime.net import free_port

pytestmark = pytest.mark.integration  # starts a server subprocess on the real model

STORIES = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K-hf"
SUMMARY_FIELDS = {
    "requests",
    "completed",
    "errors",
    "rejected",
    "error_rate",
    "rejection_rate",
    "requests_per_s",
    "tokens_per_s",
    "latency_p50",
    "latency_p95",
    "latency_p99",
    "ttft_p50",
    "ttft_p95",
    "ttft_p99",
}


@pytest.fixture(scope="module")
def naive_server(tmp_path_factory):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "bench.naive_server",
        "--model",
        str(STORIES),
        "--name",
        "stories-260k",
        "--port",
        str(port),
    ]
    log = tmp_path_factory.mktemp("naive") / "naive.log"
    server = ServerProcess(
        "naive", cmd, f"http://127.0.0.1:{port}/readyz", log, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    )
    with server:
        server.wait_ready(timeout_s=45)
        yield f"http://127.0.0.1:{port}"
    assert server.proc.poll() is not None


@pytest.mark.timeout(60)
def test_loadgen_against_naive_server(naive_server):
    workload = Workload(
        model="stories-260k",
        concurrency=2,
        max_requests=4,
        duration_s=30,
        lengths=LengthMix.parse("8:0.5,12:0.5"),
        turns=2,
        timeout_s=20,
    )
    level = asyncio.run(run_level(naive_server, workload))

    assert set(level["summary"]) >= SUMMARY_FIELDS
    assert level["summary"]["completed"] == 4
    assert level["summary"]["output_tokens"] > 0
    assert all(r["ttft_s"] is not None and r["tokens_from"] == "usage" for r in level["records"])
    assert {r["turn"] for r in level["records"]} == {0, 1}


@pytest.mark.timeout(60)
def test_length_sweep_against_naive_server(naive_server):
    """`bench.compare --sweep-lengths`: each length's loads in turn, every answer that long,
    each level labelled with it and with the machine's load average at its start."""
    workload = Workload(model="stories-260k", max_requests=2, duration_s=30, timeout_s=20)
    levels = asyncio.run(compare.sweep_lengths(naive_server, workload, [1, 2], [5, 9]))

    assert [(lv["max_tokens"], lv["load"]) for lv in levels] == [(5, 1.0), (5, 2.0), (9, 1.0), (9, 2.0)]
    assert levels[3]["load_label"] == "2 users x 9 tok"
    assert all(len(lv["loadavg_at_start"]) == 3 for lv in levels)
    for level in levels:
        assert level["summary"]["completed"] == 2
        assert {r["output_tokens"] for r in level["records"]} == {level["max_tokens"]}


@pytest.mark.timeout(60)
def test_overhead_against_naive_server(naive_server):
    turns = fixed_requests(Workload(model="x", lengths=LengthMix.parse("6")), 2)
    records = asyncio.run(overhead.measure(naive_server, "stories-260k", turns))
    row = overhead.overhead_row(records, [{"compute_s": 0.01}, {"compute_s": 0.01}])

    assert row["status"] == "ok" and row["requests"] == 2
    assert all(r.output_tokens == 6 for r in records)


@pytest.mark.timeout(60)
def test_ceiling_on_two_requests():
    lm = hf.load(STORIES)
    turns = fixed_requests(Workload(model="x", lengths=LengthMix.parse("5:0.5,9:0.5")), 2)
    level = ceiling.run_batch_size(lm, turns, batch_size=2)
    compute = ceiling.compute_times(lm, turns)

    assert level["summary"]["completed"] == 2
    assert level["summary"]["tokens_per_s"] > 0
    assert [c["max_tokens"] for c in compute] == [t.max_tokens for t in turns]
    assert all(c["compute_s"] > 0 for c in compute)


def test_prefix_ttft_times_each_turn_with_and_without_the_cache(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    args = ["--model", str(STORIES), "--dtype", "float32", "--turns", "3", "--max-tokens", "8", "--repeats", "1"]
    prefix_ttft.main([*args, "--json", str(out)])
    rows = json.loads(out.read_text())
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[0]["reused_tokens"] == 0 and rows[2]["reused_tokens"] > 0
    assert all(r["ttft_cached_cpu_s"] > 0 and r["ttft_cold_cpu_s"] > 0 for r in rows)
    assert "| 3 | " in capsys.readouterr().out


def test_report_writes_table_json_and_plot(tmp_path):
    summary = {f: 0.1 for f in SUMMARY_FIELDS} | {"tokens_per_s": 50.0}
    level = {"load": 1.0, "load_label": "1 users", "summary": summary}
    results = {
        "targets": [
            {"name": "naive", "status": "ok", "levels": [level]},
            {"name": "transformers-serve", "status": "not runnable", "reason": "why"},
        ]
    }
    paths = write_report(results, tmp_path)

    assert [p.exists() for p in paths] == [True, True, True]
    assert "not runnable: why" in paths[1].read_text()


def test_workload_and_stats_helpers():
    assert LengthMix.parse("16:0.8,128:0.2").mean == pytest.approx(38.4)
    with pytest.raises(ValueError):
        LengthMix.parse("0")
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([], 99) is None
    with pytest.raises(ValueError):
        check_local("http://example.com:8000")
