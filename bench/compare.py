"""Side by side, one run, same model, same requests: ceiling, naive, transformers serve, arenaflow, llama.cpp.

    python -m bench.compare --model .arena/models/llama-60m --out bench/results/
    python -m bench.compare --model .arena/models/llama-60m --out bench/results/ --quick
    python -m bench.compare --peers --out bench/results/peers   # SmolLM2 vs llama-server, transformers serve

Runs the ceiling in a subprocess, then starts each server in turn on a free port,
warms it up, sweeps the load levels (for each `--sweep-lengths` answer length, if
given), times the low-load overhead, and stops it before the next one starts (they
would share the CPU otherwise); the PSS of each server's processes is sampled while it
serves. Writes `results.json`, `results.md` and `results.png` under `--out`; server logs
go to `--out/logs/`. `--peers` is issue 31's run: SmolLM2-135M as `arena up` serves it,
against llama.cpp's `llama-server` (`python -m bench.peers build` first) and
`transformers serve --continuous-batching`, 1-32 users, 64- and 256-token answers;
`--targets arenaflow-llamacpp,llama-server` puts the llama.cpp backend of `arena up` beside
the same llama-server bare.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import overhead, peers, procs, targets
from bench.loadgen import add_workload_args, sweep, warm_up, workload_from_args
from bench.report import write_report
from bench.workload import LengthMix, Workload, fixed_requests
from infra.supervisor import thread_shares

ALL_TARGETS = (
    "naive",
    "transformers-serve",
    "transformers-serve-cb",
    "arenaflow-static",
    "arenaflow-continuous",
    "arenaflow-continuous-process",
    "arenaflow-continuous-thread",
    "arenaflow",
    "arenaflow-llamacpp",
    "llama-server",
    "llama-server-bf16",
)
#: What a run compares unless told: `arena up`'s defaults (the engine in a process of its
#: own); the explicit variants only when asked for.
DEFAULT_TARGETS = ALL_TARGETS[:5]
QUICK = {
    "loads": "1,4",
    "duration": 3.0,
    "max_requests": 8,
    "lengths": "16:0.8,64:0.2",
    "ceiling_requests": 8,
    "batch_sizes": "1,8",
    "overhead_requests": 3,
    "targets": "naive,transformers-serve,arenaflow-static,arenaflow-continuous",
}
#: Issue 31's comparison: `arena up` as it starts (SmolLM2, dtype auto: bfloat16 on this
#: CPU) against llama.cpp's server on SmolLM2's own Q4_1 GGUF and on a bf16 GGUF of the
#: same checkpoint, and `transformers serve --continuous-batching` in bfloat16; 64- and
#: 256-token answers, 1 to 32 closed-loop users. No ceiling, engine-alone or overhead rows.
PEERS = {
    "model": peers.SMOLLM2,
    "targets": "arenaflow,llama-server,llama-server-bf16,transformers-serve-cb",
    "loads": "1,4,8,16,32",
    "sweep_lengths": "64,256",
    "duration": 20.0,
    "dtype": "bfloat16",
    "no_ceiling": True,
    "no_engine": True,
    "overhead_requests": 0,
}


def run_ceiling(args, out: Path, workload: Workload) -> dict:
    path = out / "ceiling.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.ceiling",
        "--model",
        str(args.model),
        "--requests",
        str(args.ceiling_requests),
        "--batch-sizes",
        args.batch_sizes,
        "--lengths",
        str(workload.lengths),
        "--seed",
        str(workload.seed),
        "--compute",
        str(args.overhead_requests),
        "--dtype",
        args.dtype,
        "--out",
        str(path),
    ]
    failed = run_measurement("ceiling", cmd, args, out)
    return {**failed, "compute": []} if failed else json.loads(path.read_text())


def run_measurement(name: str, cmd: list[str], args, out: Path) -> dict | None:
    """Run an in-process measurement as a subprocess (log under `out/logs`); its failed row, or None."""
    env = {**os.environ, **targets.Setup(args.model, "", out, torch_threads=args.torch_threads).env()}
    with open(out / "logs" / f"{name}.log", "wb") as log:
        done = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.ceiling_timeout, check=False
        )
    if done.returncode == 0:
        return None
    tail = (out / "logs" / f"{name}.log").read_text(errors="replace")[-800:]
    return {"name": name, "status": "failed", "reason": tail, "levels": []}


def run_engine(args, out: Path, loads: list[float]) -> dict:
    """The engine alone (`bench.engine_speed --closed-loop`) at each load, with the torch
    threads `arena up` gives an engine stepping alone (its share for a small model): what
    serving could reach at most."""
    path = out / "engine.json"
    shares = thread_shares({}, 1)
    threads = args.torch_threads or int(shares["ARENA_TORCH_THREADS"])
    alone = 0 if args.torch_threads else int(shares["ARENA_TORCH_THREADS_ALONE"])
    cmd = [sys.executable, "-m", "bench.engine_speed", "--closed-loop", "--model", str(args.model)]
    cmd += ["--threads-alone", str(alone)]
    # One answer length swept: the engine alone at that length too (the served levels' own).
    lengths = args.sweep_lengths if args.sweep_lengths and "," not in args.sweep_lengths else args.lengths
    cmd += ["--loads", ",".join(str(int(x)) for x in loads), "--lengths", lengths, "--seed", str(args.seed)]
    cmd += ["--duration", str(args.duration), "--threads", str(threads), "--dtype", args.dtype, "--json", str(path)]
    if failed := run_measurement("engine", cmd, args, out):
        return failed
    row = json.loads(path.read_text())
    row.setdefault("threads", threads)
    return row


async def sweep_lengths(base_url: str, workload: Workload, loads: list[float], lengths: list[int]) -> list[dict]:
    """`sweep` for each answer length in turn (none: the workload's own mix); each level
    records its `max_tokens` and the machine's load average when it started."""
    levels = []
    sweeps: list[int | None] = [*lengths] or [None]
    for tokens in sweeps:
        fixed = workload if tokens is None else replace(workload, lengths=LengthMix(((tokens, 1.0),)))
        for load in loads:
            started_at = os.getloadavg()
            level = (await sweep(base_url, fixed, [load]))[0]
            level["loadavg_at_start"] = started_at
            if tokens is not None:
                level["max_tokens"] = tokens
                level["load_label"] = f"{level['load_label']} x {tokens} tok"
            levels.append(level)
    return levels


def workload_of(target: targets.Target, workload: Workload) -> Workload:
    """The workload as ``target`` is sent it: its model name, ignore_eos where it takes it, its extra fields."""
    extra = workload.body_extra + target.body_extra
    return replace(workload, model=target.served_name, ignore_eos=target.send_ignore_eos, body_extra=extra)


async def warmed(target: targets.Target, workload: Workload) -> dict | None:
    """Warm ``target`` up; its failed row's fields if nothing was answered, else None."""
    warm = await warm_up(target.base_url, workload_of(target, workload))
    if warm["summary"]["completed"] == 0:
        errors = {r["error"] for r in warm["records"]}
        return {"status": "failed", "reason": f"warm-up failed: {sorted(map(str, errors))[:2]}", "levels": []}
    return None


async def run_target(target: targets.Target, workload: Workload, loads: list[float], turns, compute, lengths) -> dict:
    if failed := await warmed(target, workload):
        return failed
    workload = workload_of(target, workload)
    levels = await sweep_lengths(target.base_url, workload, loads, lengths)
    if not turns:
        return {"status": "ok", "levels": levels}
    records = await overhead.measure(target.base_url, target.served_name, turns, target.send_ignore_eos)
    streamed = await overhead.measure(target.base_url, target.served_name, turns, target.send_ignore_eos, stream=True)
    row = overhead.overhead_row(records, compute) | overhead.first_token_row(streamed)
    return {"status": "ok", "levels": levels, "overhead": row}


def measure(name: str, setup: targets.Setup, args, workload, loads, turns, compute) -> dict:
    """Start, measure and stop one target; never raises, the row says what went wrong.
    Its processes' PSS is sampled from ready to the end of its load (`row["memory"]`)."""
    row: dict[str, Any] = {"name": name, "loadavg_at_start": os.getloadavg()}
    try:
        target = targets.prepare(name, setup)
    except targets.NotRunnable as exc:
        return {**row, "status": "not runnable", "reason": str(exc), "levels": []}
    started = time.perf_counter()
    with target.process as server:
        try:
            server.wait_ready(args.ready_timeout)
            row["startup_s"] = time.perf_counter() - started
            assert server.proc is not None  # started by the with
            with procs.PssSampler(server.proc.pid) as memory:
                row.update(asyncio.run(run_target(target, workload, loads, turns, compute, lengths_of(args))))
            row["memory"] = memory.result()
        except procs.ServerFailed as exc:
            row.update(status="failed", reason=str(exc), levels=[])
        except Exception as exc:  # noqa: BLE001 - one target's surprise must not lose the others' figures
            row.update(status="failed", reason=f"{type(exc).__name__}: {exc}\n{server.log_tail(600)}", levels=[])
    print(f"[compare] {name}: {row['status']} in {time.perf_counter() - started:.0f}s", flush=True)
    return row


def measure_interleaved(names: list[str], setup: targets.Setup, args, workload: Workload, loads) -> list[dict]:
    """Every target started at once, then each level run on each in turn (A at 1 user, B
    at 1 user, A at 8, ...): on a shared machine whose load drifts from minute to minute,
    the figures compared side by side were measured minutes apart at most. The idle
    targets wait beside the busy one (their PSS is sampled throughout)."""
    rows: dict[str, dict[str, Any]] = {n: {"name": n, "loadavg_at_start": os.getloadavg(), "levels": []} for n in names}
    live: dict[str, targets.Target] = {}
    memory: dict[str, procs.PssSampler] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            try:
                target = targets.prepare(name, setup)
                started = time.perf_counter()
                server = stack.enter_context(target.process)
                server.wait_ready(args.ready_timeout)
            except (targets.NotRunnable, procs.ServerFailed) as exc:
                rows[name].update(status="not runnable" if isinstance(exc, targets.NotRunnable) else "failed")
                rows[name]["reason"] = str(exc)
                continue
            assert server.proc is not None  # started by the with
            rows[name].update(startup_s=time.perf_counter() - started, status="ok")
            memory[name] = stack.enter_context(procs.PssSampler(server.proc.pid))
            live[name] = target
        for name, target in list(live.items()):
            if failed := asyncio.run(warmed(target, workload)):
                rows[name].update(failed)
                del live[name]
        for lengths in [[n] for n in lengths_of(args)] or [[]]:
            for load in loads:
                for name, target in live.items():
                    levels = asyncio.run(sweep_lengths(target.base_url, workload_of(target, workload), [load], lengths))
                    rows[name]["levels"] += levels
                    print(f"[compare] {name}: {levels[0]['load_label']} done", flush=True)
    for name, sampler in memory.items():
        rows[name]["memory"] = sampler.result()
    return list(rows.values())


def lengths_of(args) -> list[int]:
    """The answer lengths swept one after another (`--sweep-lengths`), or [] for the mix."""
    return [int(x) for x in args.sweep_lengths.split(",")] if args.sweep_lengths else []


def _meta(args, ceiling: dict, workload: Workload, loads: list[float]) -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.torch_threads or 'default'}",
        "model": f"{args.source} ({args.dtype} where a target takes one, CPU)"
        + (f", {ceiling['params'] / 1e6:.1f}M params" if ceiling.get("params") else ""),
        "workload": (
            f"{workload.mode} loop, loads {','.join(f'{x:g}' for x in loads)}, lengths "
            f"{args.sweep_lengths or workload.lengths}, {workload.turns} turn(s), {workload.duration_s:g}s per level, "
            f"temperature {args.temperature:g}"
        ),
        "command": "python -m bench.compare " + " ".join(args.argv),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        help="HF model directory, or a GGUF file / pkg:PACKAGE (converted once, as `arena up` does; "
        "llama-server serves the file itself)",
    )
    parser.add_argument("--name", help="served model name (default: the directory's name)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    parser.add_argument("--quick", action="store_true", help="small, short run (under ~2 min)")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="issue 31's run: SmolLM2 on arenaflow, llama-server (Q4_1, bf16), transformers serve CB (~25 min)",
    )
    parser.add_argument("--sweep-lengths", help="answer lengths swept one after another, e.g. 64,256")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the in-process generate ceiling")
    parser.add_argument("--ctx-per-slot", type=int, default=512, help="llama-server's context per slot")
    parser.add_argument("--ceiling-requests", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,4,8,16", help="ceiling batch sizes")
    parser.add_argument("--overhead-requests", type=int, default=20)
    parser.add_argument("--max-batch-size", type=int, default=16, help="arenaflow's batch limit")
    parser.add_argument("--torch-threads", type=int, help="OMP_NUM_THREADS for every process measured")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights' dtype for every row (the ceiling, the engine, each server)",
    )
    parser.add_argument("--no-engine", action="store_true", help="skip the engine-alone row")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every target at once and run each level on each in turn (a shared machine's drifting load "
        "then falls on both sides of a comparison); no overhead rows",
    )
    parser.add_argument("--ready-timeout", type=float, default=240.0)
    parser.add_argument("--ceiling-timeout", type=float, default=600.0)
    add_workload_args(parser)
    parser.set_defaults(loads="1,4,8,16")
    # --quick and --peers change the defaults, so options given with them still win.
    known = parser.parse_known_args(argv)[0]
    if known.quick:
        parser.set_defaults(**QUICK)
    if known.peers:
        parser.set_defaults(**PEERS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.model is None:
        parser.error("--model is required (or --peers, which compares on SmolLM2)")
    unknown = set(args.targets.split(",")) - set(ALL_TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; choose from {', '.join(ALL_TARGETS)}")
    if args.no_ceiling and args.overhead_requests:
        parser.error("the overhead rows subtract the ceiling's compute: give --overhead-requests 0 with --no-ceiling")
    return args


def setup_from_args(args, out: Path) -> tuple[targets.Setup, str]:
    """Every target's `Setup` (a GGUF or `pkg:` source resolved to its checkpoint) and the served name."""
    source = str(args.model)
    checkpoint, name = peers.served(source, args.name)
    loads = [int(float(x)) for x in args.loads.split(",")]
    setup = targets.Setup(
        checkpoint,
        name,
        out,
        args.max_batch_size,
        args.torch_threads,
        args.dtype,
        source=source,
        parallel=max(loads) if args.mode == "closed" else 32,
        ctx_per_slot=args.ctx_per_slot,
    )
    return setup, name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    procs.install_cleanup()
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    setup, name = setup_from_args(args, out)
    args.source, args.model = setup.source, setup.model_path  # the in-process rows load the checkpoint
    workload, loads = workload_from_args(args, name)

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    ceiling: dict = {"compute": []}
    if not args.no_ceiling:
        ceiling = run_ceiling(args, out, workload)
        ceiling["loadavg_at_start"] = load_before
        print(f"[compare] ceiling: {ceiling['status']} in {time.perf_counter() - t0:.0f}s", flush=True)
    engine = run_engine(args, out, loads) if workload.mode == "closed" and not args.no_engine else None
    if engine is not None:
        engine["loadavg_at_start"] = os.getloadavg()
        print(f"[compare] engine alone: {engine['status']}", flush=True)
    turns = fixed_requests(workload, args.overhead_requests)
    if args.interleave:
        rows = measure_interleaved(args.targets.split(","), setup, args, workload, loads)
    else:
        rows = [
            measure(t, setup, args, workload, loads, turns, ceiling.get("compute", [])) for t in args.targets.split(",")
        ]
    results = {
        "meta": _meta(args, ceiling, workload, loads),
        "targets": [
            *([] if args.no_ceiling else [{k: v for k, v in ceiling.items() if k != "compute"}]),
            *([engine] if engine else []),
            *rows,
        ],
        "overhead": {r["name"]: r["overhead"] for r in rows if "overhead" in r},
        "compute": ceiling.get("compute", []),
    }
    paths = write_report(results, out)
    print((out / "results.md").read_text())
    print(f"[compare] done in {time.perf_counter() - t0:.0f}s: " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
