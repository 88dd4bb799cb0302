"""`arena models`: hot swap (list, add, reload or remove a model on every inference
process), or withdraw / reinstate a model in the arena (an event in the stream)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from events import subjects
from events.admin import AddModel, ListModels, ModelCommand, ModelsAnswer, ModelSource, ReloadModel, RemoveModel
from infra.commands import reach
from infra.settings import OperatorSettings

#: The operations that are arena events, not hot-swap commands.
ARENA_OPS = ("withdraw", "reinstate")


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
    p.add_argument("--path", help="HF model directory (add; reload with new weights)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (see the models config)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--quantize", choices=("int8", "int4"), default=None, help="weight-only quantization (see the models config)"
    )
    p.add_argument(
        "--backend",
        choices=("builtin", "llamacpp"),
        default="builtin",
        help="add/reload: what computes its tokens; llamacpp serves a .gguf or pkg: source (see the models config)",
    )
    p.add_argument("--wait", type=float, default=30.0, help="seconds to collect answers (loads can be slow)")
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
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subjects.ADMIN_MODELS, sent.model_dump_json().encode(), reply=inbox)
    answers: list[ModelsAnswer] = []
    try:
        while True:  # the first answer may wait for a load; the others come right after it
            msg = await sub.next_msg(timeout=args.wait if not answers else 1.0)
            answers.append(ModelsAnswer.model_validate_json(msg.data))
    except Exception:  # noqa: BLE001 - a timeout ends the collection
        pass
    await nc.close()
    if args.op == "list" and not args.json:
        print(table(answers))
    else:
        for a in answers:
            print(a.encode().decode())
    if not answers:
        print("no inference process answered", file=sys.stderr)
    return 0 if answers and all(a.ok for a in answers) else 1


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
