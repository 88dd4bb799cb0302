"""How this worker's engines run their models: one typed value, built once from the
settings (`InferenceSettings.engine_config`) and handed whole to the runner factory, the
engine process and the batch engine (as vLLM's `EngineCore(vllm_config, ...)` takes one
config tree).

A new engine setting is a field here, its environment variable in `settings.py` (and a
line of `engine_config`), and its use where it is read (`BatchEngine.configured`, the
engine process, the runner factory): nothing in between carries it by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Every model engine's configuration, whatever backend steps it and wherever."""

    mode: Literal["static", "continuous"] = "continuous"
    """'static': a micro-batch runs to completion before the next is admitted;
    'continuous': requests join and leave the running batch at every step."""
    max_batch_size: int = 64
    """Most requests decoded together (a llama-server's parallel slots too)."""
    max_wait_s: float = 0.0
    """The static mode's hold: how long a micro-batch waits to fill before it starts
    (0: none, as in continuous mode)."""
    kv_budget_bytes: int | None = None
    """The batch engine's KV slab budget (None: unbounded): a request joins the batch
    only while every row at its longest fits."""
    prefix_cache_bytes: int = 0
    """The batch engine's prefix cache budget (0: off)."""
    in_process: bool = True
    """Step each built-in engine in a child process of its own (its own GIL) where its
    weights fit /dev/shm; False: on a thread beside the worker's event loop."""
    step_profile: bool = False
    """Time decode steps at one request and at every slot before serving (the runner's
    profile), and re-measure them while idle."""
    step_figures_dir: str = ""
    """Where measured step times are kept between processes (empty: not kept)."""
    torch_threads: int = 0
    """An engine process's torch intra-op threads (0: torch's default)."""
    torch_threads_alone: int = 0
    """An engine process's threads while no other engine of the machine steps (0, or no
    more than ``torch_threads``: always ``torch_threads``)."""
    cores_dir: str | None = None
    """Where the machine's engines note their steps, so each sizes its threads to the
    load (runners/cores.py)."""
    llama_cpp_dir: str = ""
    """Where `llama-server` is built and found (`backend: llamacpp` models)."""
    llama_cpp_threads: int = 0
    """A llama-server's `--threads` when its model's config names none (0: every core)."""

    def timing_key(self) -> dict[str, Any]:
        """What of it can change an engine's step times (every field but where things are
        kept): part of the key under which measured steps are kept."""
        places = {"step_figures_dir", "cores_dir", "llama_cpp_dir"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in places}
