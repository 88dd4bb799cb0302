"""`arena up`: start everything on this machine (see `infra.supervisor`)."""

from __future__ import annotations

import argparse

from infra import up_models
from infra.servers import NATS_SYNC_DEFAULT, nats_sync
from infra.settings import OperatorSettings
from infra.supervisor import up


def _nats_sync(value: str) -> str:
    try:
        return nats_sync(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("up", help="start everything on this machine")
    p.set_defaults(run=run)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="gateway port (default 8000; 0 picks a free one)")
    p.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--models-config", default=None, help="YAML/JSON file listing served models")
    p.add_argument(
        "--model",
        action="append",
        type=up_models.parse,
        default=[],
        metavar="[NAME=]SOURCE",
        help="serve this model: a Hugging Face checkpoint directory, a .gguf file or pkg:PACKAGE (repeatable; "
        "beside --models-config's models, if given); the first is the default model",
    )
    p.add_argument(
        "--with-arena-models",
        action="store_true",
        help="with --model: serve the default arena models (configs/arena-models.yaml, warmed) beside yours, so "
        "arena battles run; yours stays the default model",
    )
    p.add_argument(
        "--default-model",
        default=None,
        help="the model a request that names none gets (default: the models config's default_model:, else its "
        "first model; the first --model); one the config has not is refused",
    )
    p.add_argument("--engine", choices=("continuous", "static"), default="continuous")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="step each model's engine in a child process of the inference worker (its own GIL; the default), "
        "or, with --no-engine-process, on a thread of the worker",
    )
    p.add_argument("--inference-replicas", type=int, default=1)
    p.add_argument(
        "--standby",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep a warm spare inference process (imported, waiting at a lower priority) to replace a worker "
        "that dies at once; --no-standby restarts a cold one (docs/operations.md, 'Restarts')",
    )
    p.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="start an N-node JetStream cluster on loopback (stream at R3) instead of one server",
    )
    p.add_argument(
        "--nats-sync",
        type=_nats_sync,
        default=NATS_SYNC_DEFAULT,
        metavar="always|DURATION",
        help=f"when the nats-server it starts fsyncs what JetStream acknowledged: 'always' (before the ack) "
        f"or every DURATION, e.g. 2m (default: {NATS_SYNC_DEFAULT}; docs/operations.md, 'Durability')",
    )
    p.add_argument("--state-dir", default=OperatorSettings().state_dir)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument(
        "--no-nats-auth",
        dest="nats_auth",
        action="store_false",
        help="the embedded nats-server takes any local connection (default: per-role users, fresh passwords)",
    )


def run(args: argparse.Namespace) -> int:
    return up(args, up_models.settle(args))
