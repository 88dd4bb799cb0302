"""A full garbage collection in a gateway and in an inference process, before and after
startup's objects are frozen (runtime/heap.py). Each process kind is built in a child
process as it starts for real (the gateway's app; torch, transformers and the default
model for inference). Prints figures; asserts nothing.

    python -m bench.heap [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import gc, json, statistics, sys, time
kind, repeat = sys.argv[1], int(sys.argv[2])
if kind == "gateway":
    from gateway.app import build_app
    from gateway.settings import GatewaySettings
    from tests.unit.fake_pipeline import FakePipeline
    settings = GatewaySettings()
    keep = build_app(settings, FakePipeline(settings))
else:
    import consumers.inference.app
    from consumers.inference.model_loading import load_model, load_models_config
    from consumers.inference.settings import InferenceSettings
    settings = InferenceSettings()
    specs = load_models_config(settings.models_config, settings.models_dir)
    keep = load_model(next(s for s in specs if s.name == settings.default_model))
from runtime import heap
heap.enable()

def full_ms():
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2)

objects, before = len(gc.get_objects()), full_ms()
heap.freeze()
print(json.dumps({"process": kind, "objects": objects, "full_collection_ms": before, "after_freeze_ms": full_ms()}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="collections timed per figure (median)")
    args = parser.parse_args(argv)
    for kind in ("gateway", "inference"):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, kind, str(args.repeat)], capture_output=True, text=True, check=False
        )
        line = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
        print(line[0] if line else json.dumps({"process": kind, "error": out.stderr.strip()[-500:]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
