"""llama.cpp's `llama-server`, built once from source and found again: what the llama.cpp
backend runs for a model with `backend: llamacpp`.

    python -m consumers.inference.llamacpp build    # fetch the pinned sdist, build llama-server (15-55 min on 2 cores)
    python -m consumers.inference.llamacpp show     # where it is, or the command that makes it

llama.cpp comes from the `llama-cpp-python` sdist on PyPI (it vendors the whole tree,
`convert_hf_to_gguf.py` included), fetched with pip. Everything lands under
`ARENA_LLAMA_CPP_DIR` (default `~/.cache/arenaflow/llama.cpp`): outside the checkout, so a
clean checkout on the same machine (CI, a new session) reuses a finished build, and
`build` returns at once when the binary is there. cmake's progress lines are printed as
they come and kept in `build.log` there.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from consumers.inference.errors import PermanentError

#: The sdist the figures were made with (llama.cpp as vendored by it): pinned, so a rebuild
#: (another checkout, CI) serves the same code.
SDIST = "llama-cpp-python==0.3.36"
#: The command that builds it, as an error names it.
BUILD_COMMAND = "python -m consumers.inference.llamacpp build"
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


class LlamaServerMissing(PermanentError):
    """No built `llama-server` where the settings say: the message names the build command."""


def build_dir(root: Path) -> Path:
    return root / "build"


def server_path(root: Path) -> Path:
    """Where the built `llama-server` is (or will be) under ``root``."""
    return build_dir(root) / "bin" / "llama-server"


def locate(root: str | Path) -> Path:
    """The built `llama-server` under ``root``; LlamaServerMissing saying how to build it otherwise."""
    server = server_path(Path(root).expanduser())
    if not server.is_file():
        raise LlamaServerMissing(
            f"no llama-server at {server}: build it once with `{BUILD_COMMAND}` "
            "(15-55 min on 2 cores; ARENA_LLAMA_CPP_DIR says where)"
        )
    return server


def sdist(root: Path) -> Path:
    """The pinned sdist, fetched by pip the first time."""
    folder = root / "sdist"
    archive = folder / f"{SDIST.replace('-', '_').replace('==', '-')}.tar.gz"
    if not archive.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, SDIST, "-d", str(folder)], check=True)
    return archive


def source_tree(root: Path, archive: Path | None = None) -> Path:
    """The vendored llama.cpp tree of the sdist, extracted once under `root/src/`."""
    archive = archive or sdist(root)
    stem = archive.name.removesuffix(".tar.gz")
    tree = root / "src" / stem / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").is_file():
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{stem}/vendor/llama.cpp/")]
            tar.extractall(root / "src", members=members, filter="data")
    return tree


def cmake_commands(tree: Path, build: Path, jobs: int) -> list[list[str]]:
    """Configure, then build the one target the backend runs."""
    return [
        ["cmake", "-S", str(tree), "-B", str(build), *CMAKE_FLAGS],
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
    ]


def _run_logged(cmd: list[str], log: IO[str], say: Callable[[str], None]) -> None:
    """Run under `nice -n 19` (the machine is shared), keep every line, print the progress ones."""
    proc = subprocess.Popen(["nice", "-n", "19", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        if line.startswith("[") or line.startswith("-- Build files") or "error" in line.lower():
            say(line.rstrip())
    if proc.wait() != 0:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({proc.returncode}); see {log.name}")


def build(root: str | Path, jobs: int = 2, say: Callable[[str], None] = print) -> Path:
    """`llama-server` under ``root``, built now unless a finished build is there."""
    root = Path(root).expanduser()
    server = server_path(root)
    if server.is_file():
        say(f"[llama.cpp] reusing {server}")
        return server
    tree = source_tree(root)
    say(f"[llama.cpp] building llama-server from {tree} into {build_dir(root)} (log: {root / 'build.log'})")
    with open(root / "build.log", "a") as log:
        for cmd in cmake_commands(tree, build_dir(root), jobs):
            _run_logged(cmd, log, say)
    return server
