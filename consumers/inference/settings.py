"""The inference process's settings (`arena run inference`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from consumers.inference.config import EngineConfig
from consumers.inference.runners.cores import DEFAULT_DIR as DEFAULT_CORES_DIR
from runtime import models_config as config_file
from runtime.settings import REPO, CommonSettings


def _default_models_dir() -> str:
    return str(REPO.parent / "shared" / "models")


class InferenceSettings(CommonSettings):
    models_dir: str = Field(
        default_factory=_default_models_dir, description="Where relative model paths are looked up."
    )
    warm_models: list[str] = Field(
        default_factory=lambda fields: config_file.warm_models(
            fields.get("models_config"), fields.get("default_model")
        ),
        description="Loaded at start (the default model first). Unset: the default model and the models config's "
        "`warm:` list.",
    )
    model_cache: str = Field(
        str(Path.home() / ".cache" / "arenaflow" / "models"),
        description="Where a GGUF model source is converted to a checkpoint once (a directory per file hash).",
    )
    llama_cpp_dir: str = Field(
        str(Path.home() / ".cache" / "arenaflow" / "llama.cpp"),
        description="Where llama.cpp's `llama-server` is built and found (`backend: llamacpp` models; "
        "`python -m consumers.inference.llamacpp build`): outside the checkout, so checkouts share one build.",
    )
    engine: Literal["static", "continuous"] = Field(
        "continuous", description="'static' (padded micro-batches) or 'continuous'."
    )
    max_batch_size: int = Field(
        64,
        ge=1,
        le=512,
        description="Most requests decoded together; more rows make more tokens a second until a step is bound by "
        "arithmetic (docs/inference.md, Pulling and batching).",
    )
    max_wait_ms: int = Field(
        10, ge=0, le=10_000, description="Static engine: longest a micro-batch waits to fill before it starts."
    )
    chunk_tokens: int = Field(4, ge=1, le=256, description="Tokens per TokensGenerated event.")
    memory_budget_mb: float | None = Field(None, gt=0, description="Model pool budget; default: 60% of RAM.")
    kv_cache_mb: float = Field(
        4096,
        gt=0,
        description="Each model engine's KV cache budget (vLLM's CPU default): a request joins a batch only while "
        "every row at its longest fits; one that alone cannot is a 400.",
    )
    cuda_memory_fraction: float = Field(
        0.85,
        gt=0,
        le=1,
        description="On CUDA: the share of the GPU's memory this process's torch allocator may use "
        "(set_per_process_memory_fraction).",
    )
    drain_grace_s: float = Field(10.0, ge=0, description="On SIGTERM, how long to finish held work.")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads; 0 keeps torch's default.")
    torch_threads_alone: int = Field(
        0,
        ge=0,
        description="An engine process's torch threads for a step while no other engine on this machine steps "
        "(noted in cores_dir); ARENA_TORCH_THREADS while one does. 0, or no more than torch_threads: always "
        "torch_threads. Models under 10M parameters keep torch_threads. `arena up` gives each inference replica "
        "its share of every core.",
    )
    cores_dir: str = Field(
        DEFAULT_CORES_DIR,
        description="Where the machine's engine processes note their steps (a file each), so each sizes its "
        "threads to the load (torch_threads_alone; unused without it). Engines that share cores must share it; one "
        "that cannot be made (a read-only home) is logged and the engines keep torch_threads.",
    )
    llama_cpp_threads: int = Field(
        0,
        ge=0,
        description="`--threads` of a `backend: llamacpp` model's llama-server when its config names none; 0: every "
        "core this worker may use. `arena up` gives each inference replica its share of the cores.",
    )
    prefix_cache_mb: float = Field(
        256.0,
        ge=0,
        description="Per model engine: MB of finished sequences' keys and values kept, so a conversation's next "
        "turn on this worker prefills only its new tokens (least recently used out first; 0: off).",
    )
    step_profile: bool = Field(
        True,
        description="When an engine starts, before it serves: time its decode steps with synthetic requests, one "
        "alone and one in every slot (requests that come meanwhile wait for it), so admission judges a first burst "
        "by a measured full batch (`docs/admission.md`).",
    )
    step_figures_dir: str = Field(
        str(Path.home() / ".cache" / "arenaflow" / "step-figures"),
        description="Where each engine keeps its measured step times (a file per model, engine settings, "
        "machine and engine code, rewritten every 30 s): an engine of the same model starting within 15 minutes "
        "of the last write (a worker restarted after a crash) takes them instead of profiling. Empty: off.",
    )
    engine_process: bool = Field(
        True,
        description="Step each model's engine in a child process (its own GIL), not in a thread beside the loop; "
        "false: on a thread of the worker (no second Python runtime, ~0.4 GB less).",
    )

    def engine_config(self) -> EngineConfig:
        """The engines' configuration, built once from these settings (config.py)."""
        return EngineConfig(
            mode=self.engine,
            max_batch_size=self.max_batch_size,
            max_wait_s=self.max_wait_ms / 1000 if self.engine == "static" else 0.0,
            kv_budget_bytes=int(self.kv_cache_mb * 2**20),
            prefix_cache_bytes=int(self.prefix_cache_mb * (1 << 20)),
            in_process=self.engine_process,
            step_profile=self.step_profile,
            step_figures_dir=self.step_figures_dir,
            torch_threads=self.torch_threads,
            torch_threads_alone=self.torch_threads_alone,
            cores_dir=self.cores_dir,
            llama_cpp_dir=self.llama_cpp_dir,
            llama_cpp_threads=self.llama_cpp_threads,
        )
