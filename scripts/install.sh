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
.venv/bin/python -m pip install -q -e ".[test,bench]"
.venv/bin/python - <<'PY'
from importlib.metadata import version
print("installed:", ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "faststream", "nats-py")))
PY
