"""`arena run ROLE`: one process of the topology (settings from ARENA_* variables)."""

from __future__ import annotations

import argparse
import importlib
import os

from consumers.inference import forks
from consumers.inference.settings import InferenceSettings
from events import topology
from runtime import heap, logs
from runtime.settings import CommonSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="run one process (settings from ARENA_* variables)")
    p.set_defaults(run=run)
    p.add_argument("role", choices=topology.role_names())


def run(args: argparse.Namespace) -> int:
    return run_role(args.role)


def run_role(role: str) -> int:
    """Run one process of the topology (blocking), with JSON logs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module, func = topology.role(role).entry.split(":")
    logs.setup(CommonSettings().log_level, role)
    heap.enable()  # startup's objects are frozen out of the collector once the process is up
    if role == topology.INFERENCE.name:
        heap.mmap_threshold()  # freed activations go back to the system (an engine process sets its own)
    if role == topology.INFERENCE.name and InferenceSettings().engine_process:
        forks.start()  # the engine processes' fork server imports torch beside this process's imports
    getattr(importlib.import_module(module), func)()
    return 0
