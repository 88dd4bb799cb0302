#!/usr/bin/env bash
# What the test suite needs beyond `scripts/install.sh`, each step skipped when already there:
# Debian's chromium, prometheus, kubectl and stress-ng (apt-get, as root), cmake and g++, and a llama-server
# built from the pinned llama-cpp-python sdist. It writes nothing in the checkout.
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
# The contention tests run `arena up` beside a CPU hog (tests/e2e/test_contention.py).
command -v stress-ng >/dev/null || missing+=(stress-ng)
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
# Not here: the filter encoder's weights. The tests run the encoder's code on a build of their own
# (two fine-tuning steps, tests/unit/tiny_encoder.py); what the trained stage catches is the lab's
# own target, on the weights `arena filter-train --encoder` builds (12-20 min on 2 cores; the stage
# is in shadow by default): `arena filter-train --encoder && python -m pytest lab/tests`.
echo "test-setup: ready"
