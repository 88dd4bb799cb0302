"""The servers a comparison measures: how each starts, and why one may not run here.

Every target serves the same model directory on 127.0.0.1 and a free port. `prepare`
returns the `ServerProcess` to start, or raises `NotRunnable` with the reason, which
the report prints in that target's row instead of figures.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.procs import ServerProcess
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
        "--dtype",
        setup.dtype,
        model,
    ]
    proc = ServerProcess(name, cmd, f"http://127.0.0.1:{port}/health", setup.out / "logs" / f"{name}.log", env=env)
    # It refuses unknown request fields (ignore_eos) with 422, and a model name other
    # than the path it was started with.
    return Target(name, proc, model, f"http://127.0.0.1:{port}", send_ignore_eos=False)


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


BUILDERS = {
    "naive": naive,
    "transformers-serve": transformers_serve,
    "transformers-serve-cb": lambda s: transformers_serve(s, continuous=True),
    "arenaflow-static": lambda s: arena(s, "static"),
    "arenaflow-continuous": lambda s: arena(s, "continuous"),
    # The same with each model's engine in a process of its own (the default) or on a thread of the worker.
    "arenaflow-continuous-process": lambda s: arena(s, "continuous", engine_process=True),
    "arenaflow-continuous-thread": lambda s: arena(s, "continuous", engine_process=False),
}


def prepare(name: str, setup: Setup) -> Target:
    return BUILDERS[name](setup)
