#!/usr/bin/env bash
# What the test suite needs beyond `scripts/install.sh`, each step skipped when already there:
# Debian's chromium, prometheus and kubectl (apt-get, as root), cmake and g++, a llama-server
# built from the pinned llama-cpp-python sdist, and the filter encoder's weights.
# Run after scripts/install.sh; the README's test command and .ci/run both run it.
set -uo pipefail
cd "$(dirname "$0")/.."
missing=()
# The arena page's browser test drives Debian's chromium (playwright without its download).
[ -x /usr/bin/chromium ] || missing+=(chromium)
# The monitoring tests run Debian's Prometheus against `arena up` and promtool on the alert rules.
{ command -v prometheus >/dev/null && command -v promtool >/dev/null; } || missing+=(prometheus)
# The Kubernetes manifest tests render infra/k8s with `kubectl kustomize`.
command -v kubectl >/dev/null || missing+=(kubectl)
# The llama.cpp backend is compiled from source.
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "test-setup: apt-get install ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" || exit 1
fi
# The llama.cpp backend's tests run a real llama-server: built once from the pinned
# llama-cpp-python sdist into ARENA_LLAMA_CPP_DIR (default ~/.cache/arenaflow/llama.cpp,
# outside the checkout), reused by every later run; a fresh build is 6-55 min on 2 cores.
start=$(date +%s)
.venv/bin/python -m consumers.inference.llamacpp build || exit 1
echo "test-setup: llama-server ready in $(( $(date +%s) - start )) s"
# The filter encoder's weights (23 MB) are built, not committed: reused from the model cache
# (~/.cache/arenaflow/models/prompt-encoder), else fine-tuned now (5-20 min on 2 cores).
# A CPU whose float kernels differ builds other weights under another version: the
# manifest's tests then name the build to commit (docs/filter.md, the encoder stage).
if ! HF_HUB_OFFLINE=1 .venv/bin/python -c "from consumers.filter.encoder import load_encoder as f; f('consumers/filter/artifacts/prompt-encoder')" 2>/dev/null; then
  echo "test-setup: the filter encoder's weights are not in the model cache: fine-tuning them"
  HF_HUB_OFFLINE=1 .venv/bin/arena filter-train --encoder || exit 1
fi
echo "test-setup: ready"
