"""`python -m consumers.inference.llamacpp build|show`: the llama.cpp backend's binary."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from consumers.inference.llamacpp.build import __doc__ as build_doc
from consumers.inference.llamacpp.build import build, locate, server_path
from consumers.inference.settings import InferenceSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m consumers.inference.llamacpp",
        allow_abbrev=False,
        description=(build_doc or "").splitlines()[0],
    )
    parser.add_argument("command", choices=("build", "show"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="cmake --build -j")
    args = parser.parse_args(argv)
    root = Path(InferenceSettings().llama_cpp_dir).expanduser()
    if args.command == "build":
        print(build(root, args.jobs))
        return 0
    try:
        print(locate(root))
    except Exception as exc:  # noqa: BLE001 - shown as it is
        print(f"missing: {exc}", file=sys.stderr)
        print(server_path(root))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
