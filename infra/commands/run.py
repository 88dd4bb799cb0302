"""`arena run ROLE`: one process of the topology (settings from ARENA_* variables).

An inference worker forks its engine fork server from itself once it has imported torch
and transformers, before it starts anything (consumers.inference.runners.forks.start_forked): the
worker, the server and the engine processes share those pages. A worker whose models all
run on llama.cpp (`backend: llamacpp`) has no engine process, and no fork server.

`arena run inference --standby` is `arena up`'s warm spare: it does everything a worker
does before it reads its settings (imports torch and transformers, forks its engine
fork server: ~6 s of CPU on a slow 2-core VM), then waits. When a worker dies, the
supervisor promotes it instead of starting a cold process: one JSON line on its stdin
gives it the dead worker's environment, log file and priority, and it runs as that
worker from there (see infra.supervisor.Stack.promote).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from consumers.inference.runners import forks
from consumers.inference.settings import InferenceSettings
from events import topology
from runtime import heap, logs
from runtime.settings import CommonSettings


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="run one process (settings from ARENA_* variables)")
    p.set_defaults(run=run)
    p.add_argument("role", choices=topology.role_names())
    p.add_argument(
        "--standby",
        action="store_true",
        help="import everything, then wait for one JSON line on stdin (env, log, nice) and run as that process",
    )


def run(args: argparse.Namespace) -> int:
    return run_role(args.role, standby=args.standby)


def run_role(role: str, standby: bool = False) -> int:
    """Run one process of the topology (blocking), with JSON logs; ``standby``: once
    imported, wait to be promoted first (:func:`promoted`), and exit 0 if stdin closes
    before that."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module, func = topology.role(role).entry.split(":")
    logs.setup(CommonSettings().log_level, role)
    heap.enable()  # startup's objects are frozen out of the collector once the process is up
    if role == topology.INFERENCE.name:
        heap.mmap_threshold()  # freed activations go back to the system (an engine process sets its own)
    engines = role == topology.INFERENCE.name and engine_processes(InferenceSettings())
    main = getattr(importlib.import_module(module), func)
    if engines:  # a fork of this process, imported: it shares the pages of what it imported
        forks.start_forked()
    if standby:
        if engines:
            forks.wait_ready()
        logging.getLogger(__name__).info("standby for %s: imported, waiting to be promoted", role)
        if not promoted(sys.stdin.buffer.readline()):
            return 0
    main()
    return 0


def engine_processes(settings: InferenceSettings) -> bool:
    """Whether a worker with these settings will run engine processes: they are on and a
    model of its config runs on the built-in engine (a ``backend: llamacpp`` model's engine
    is its llama-server). An unreadable config says yes, as before it was read (the worker
    reports the error). A model added later that needs one starts a fork server then
    (``forks.start``: a new interpreter)."""
    if not settings.engine_process:
        return False
    from consumers.inference.model_loading import load_models_config  # noqa: PLC0415 - torch: the worker only, not the CLI

    try:
        specs = load_models_config(settings.models_config, settings.models_dir)
    except Exception:  # noqa: BLE001 - the worker itself says what is wrong with it
        return True
    return any(spec.backend == "builtin" for spec in specs)


def promoted(line: bytes) -> bool:
    """Become the process the supervisor's line describes: its environment (the same as the
    standby's but for per-process values such as its metrics port), its log file on
    stdout and stderr, and its priority (the standby waits at a lower one, and so does its
    engine fork server, which the engines are forked from). False when there is no line."""
    if not line.strip():
        return False
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    logs.output_to(order["log"])
    forks.log_file = order["log"]  # the engine processes its fork server forks write there too
    pids = [0, *forks.server_pids()]
    try:
        for pid in pids:
            os.setpriority(os.PRIO_PROCESS, pid, order["nice"])
    except OSError as exc:  # raising a priority back needs CAP_SYS_NICE (root here, not in every container)
        logging.getLogger(__name__).warning("promoted standby keeps its lower priority: %r", exc)
    logging.getLogger(__name__).info("standby promoted (pid %d)", os.getpid())
    return True
