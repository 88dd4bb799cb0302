"""The `arena` command."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import socket
import sys
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlparse

import nats

from consumers.filter.evaluate import main as filter_eval
from consumers.inference import forks
from events import subjects, topology
from events.readmodel import ReadModel
from infra import up_models
from infra.asyncapi import schema_json
from infra.replay import audit_window, parse_window
from infra.servers import NATS_SYNC_DEFAULT, nats_sync, start_nats
from infra.supervisor import up
from runtime import heap, jetstream, logs
from runtime.recovery import rebuild
from runtime.redis import masked, redis_client
from runtime.settings import CommonSettings, InferenceSettings, OperatorSettings
from runtime.stream import conversation_events, request_events


def run_role(role: str) -> int:
    """Run one process of the topology (blocking), with JSON logs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    module, func = topology.role(role).entry.split(":")
    logs.setup(CommonSettings().log_level, role)
    heap.enable()  # startup's objects are frozen out of the collector once the process is up
    if role == topology.INFERENCE.name and InferenceSettings().engine_process:
        forks.start()  # the engine processes' fork server imports torch beside this process's imports
    getattr(importlib.import_module(module), func)()
    return 0


def _reachable(url: str) -> bool:
    """Any of the servers in `url` (comma-separated for a cluster) answers on its port."""
    for one in jetstream.servers(url):
        parsed = urlparse(one)
        try:
            with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout=1):
                return True
        except OSError:
            continue
    return False


def _endpoints(state_dir: str) -> dict:
    path = Path(state_dir) / "endpoints.json"
    return json.loads(path.read_text()) if path.exists() else {}


@asynccontextmanager
async def _jetstream(args):
    """The stream to read: --nats-url, NATS_URL, a running `arena up`, or (when it is
    stopped) a temporary nats-server on the store `arena up` left behind."""

    url = args.nats_url or OperatorSettings().nats_url or _endpoints(args.state_dir).get("nats_url")
    server = None
    nc = None
    if url and _reachable(url):
        nc = await nats.connect(
            jetstream.servers(url),
            connect_timeout=2,
            allow_reconnect=False,
            **jetstream.connect_options(OperatorSettings()),  # the operator's user and TLS, where set
        )
    if nc is None:
        store = Path(args.state_dir) / "nats"
        if not store.exists():
            raise SystemExit(f"no NATS server reachable and no stored stream at {store}; pass --nats-url")
        server = start_nats(store)
        nc = await nats.connect(server.url)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()
        if server:
            server.stop()


def _line(event) -> str:
    d = event.model_dump(mode="json")
    keep = {
        k: v
        for k, v in d.items()
        if k not in ("event_id", "request_id", "conv_id", "occurred_at", "type", "schema_version")
    }
    text = json.dumps(keep, ensure_ascii=False)
    if "battle_id" in d:
        return f"{d['occurred_at']}  {event.type:<17} battle={d['battle_id']}  {text[:300]}"
    return f"{d['occurred_at']}  {event.type:<17} req={event.request_id} turn={event.turn_id}  {text[:300]}"


async def _replay(args) -> int:

    async with _jetstream(args) as js:
        if args.battle_id:
            from infra import arena_cli  # noqa: PLC0415 - numpy stays out of the processes `arena run` starts

            events = await arena_cli.replay_battle(js, args.battle_id)
        elif args.request_id:
            events = await request_events(js, args.request_id)
        else:
            events = await conversation_events(js, args.conv_id)
    for e in events:
        print(e.model_dump_json() if args.json else _line(e))
    if not events:
        print("no events found", file=sys.stderr)
        return 1
    return 0


async def _rebuild(args) -> int:
    """Refill Redis's read model (pending records, results) from the stream."""
    url = args.redis_url or OperatorSettings().redis_url or _endpoints(args.state_dir).get("redis_url")
    if not url:
        raise SystemExit("no Redis to rebuild: pass --redis-url (or REDIS_URL), or run `arena up`")
    store = ReadModel(redis_client(url), CommonSettings().result_ttl_s)
    since = datetime.now(UTC) - parse_window(args.since)
    try:
        async with _jetstream(args) as js:
            counts = await rebuild(js, store, since)
    finally:
        await store.redis.aclose()
    print(f"rebuilt from the stream: {counts['requests']} requests, {counts['results']} results, into {masked(url)}")
    return 0


async def _audit(args) -> int:

    async with _jetstream(args) as js:
        report = await audit_window(js, parse_window(args.since))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"requests: {report['requests']}  in flight: {len(report['in_flight'])}")
        print(f"missing terminal event: {len(report['missing_terminal'])}")
        for r in report["missing_terminal"]:
            print(f"  {r}")
        print(f"more than one terminal event: {len(report['duplicate_terminal'])}")
        for r in report["duplicate_terminal"]:
            print(f"  {r}")
        print(f"battles: {report['battles']}  votes: {report['votes']}")
        for key in ("votes_without_battle", "battles_with_several_votes"):
            print(f"{key.replace('_', ' ')}: {len(report[key])}")
            for b in report[key]:
                print(f"  {b}")
        for rule, battles in report["votes_not_counted"].items():
            print(f"votes not counted ({rule}): {len(battles)}  {' '.join(battles[:10])}")
        print("OK" if report["ok"] else "PROBLEMS FOUND")
    return 0 if report["ok"] else 1


async def _arena(args) -> int:
    from infra import arena_cli  # noqa: PLC0415 - numpy stays out of the processes `arena run` starts

    if args.cmd == "battles" and args.op in ("import", "invalidate", "reinstate") and not args.file:
        raise SystemExit(f"arena battles {args.op} needs {'a FILE' if args.op == 'import' else 'a BATTLE_ID'}")
    if args.cmd in ("battles", "models") and args.op in ("invalidate", "reinstate", "withdraw") and not args.reason:
        raise SystemExit(f"arena {args.cmd} {args.op} needs --reason (it is recorded on the event)")
    if args.cmd == "models" and not args.name:
        raise SystemExit(f"arena models {args.op} needs --name")
    if args.cmd == "leaderboard" and args.history and (args.style_control or args.category):
        raise SystemExit("arena leaderboard --history lists models, not ratings: no --style-control or --category")
    async with _jetstream(args) as js:
        if args.cmd == "models":
            return await arena_cli.set_model_status(js, args.name, args.op == "withdraw", args.reason)
        if args.cmd == "leaderboard" and args.history:
            return await arena_cli.history(js, args.at, args.json)
        if args.cmd == "leaderboard":
            return await arena_cli.leaderboard(js, args.at, args.json, args.style_control, args.category)
        if args.op in ("invalidate", "reinstate"):
            return await arena_cli.set_vote_status(js, args.file, args.op == "reinstate", args.reason)
        if args.op == "import":
            await js.stream_info(subjects.STREAM)  # the stream must exist (arena up ran)
            return await arena_cli.import_battles(js, args.file)
        return await arena_cli.export_battles(js, args.file)


def _asyncapi(args) -> int:

    text = schema_json()
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


async def _models(args) -> int:
    """Send a hot-swap command to every inference process and print their answers."""

    command: dict = {"op": args.op}
    if args.op in ("add", "reload", "remove"):
        if not args.name:
            raise SystemExit(f"arena models {args.op} needs --name")
        command["name"] = args.name
    if args.op == "add" or (args.op == "reload" and args.path):
        if not args.path:
            raise SystemExit("arena models add needs --path")
        command["spec"] = {
            "name": args.name,
            "path": str(Path(args.path).resolve()) if Path(args.path).exists() else args.path,
            "dtype": args.dtype,
            "device": args.device,
            "quantize": args.quantize,
        }
    url = args.nats_url or OperatorSettings().nats_url or _endpoints(args.state_dir).get("nats_url")
    if not url or not _reachable(url):
        raise SystemExit("no NATS server reachable; is `arena up` running? (or pass --nats-url)")
    nc = await nats.connect(
        jetstream.servers(url), allow_reconnect=False, **jetstream.connect_options(OperatorSettings())
    )
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subjects.ADMIN_MODELS, json.dumps(command).encode(), reply=inbox)
    answers: list[dict] = []
    try:
        while True:  # the first answer may wait for a load; the others come right after it
            msg = await sub.next_msg(timeout=args.wait if not answers else 1.0)
            answers.append(json.loads(msg.data))
    except Exception:  # noqa: BLE001 - a timeout ends the collection
        pass
    await nc.close()
    if args.op == "list" and not args.json:
        print(_models_table(answers))
    else:
        for a in answers:
            print(json.dumps(a))
    if not answers:
        print("no inference process answered", file=sys.stderr)
    return 0 if answers and all(a.get("ok") for a in answers) else 1


def _models_table(answers: list[dict]) -> str:
    """`arena models list`: each process's models, one row each."""
    blocks = []
    for a in sorted(answers, key=lambda a: a.get("instance", "")):
        rows = [("NAME", "SOURCE", "PARAMETERS", "DTYPE", "CONTEXT", "CHAT TEMPLATE", "RESIDENT")]
        for d in a.get("details", []):
            loaded = d["resident"]
            rows.append(
                (
                    d["name"] + (f" (variant of {d['base']})" if d.get("base") else ""),
                    d["source"],
                    f"{d['parameters'] / 1e6:.1f}M" if loaded else "-",
                    (d["dtype"] + (f" + {d['quantize']}" if d.get("quantize") else "")) if loaded else "-",
                    str(d["context"] or "?"),
                    ("yes" if d["chat_template"] else "no (plain text)") if loaded else "-",
                    f"{d['resident_bytes'] / 1e6:.0f} MB" if loaded else "not loaded",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        blocks.append("\n".join([f"{a.get('instance')}:", *lines]))
    return "\n\n".join(blocks)


async def _topology() -> int:
    """What a process with per-role permissions may not do: the operator creates the
    stream and the durables (a Job on Kubernetes)."""
    settings = CommonSettings()
    nc = await jetstream.connect(settings.nats_url, "arena-topology", **jetstream.connect_options(settings))
    try:
        await jetstream.ensure_topology(nc.jetstream(), settings.retention_days, **settings.topology())
    finally:
        await nc.close()
    print(f"stream {subjects.STREAM} and durables {[r.durable for r in topology.consumers()]} in place")
    return 0


def _nats_sync(value: str) -> str:
    try:
        return nats_sync(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Parser(argparse.ArgumentParser):
    """No abbreviated options, in `arena` and every subcommand (subparsers are of their
    parent's class): `arena up --model X` must never be taken for `--models-config X`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="arena", description="arenaflow: LLM serving on NATS JetStream")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start everything on this machine")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=None, help="gateway port (default 8000; 0 picks a free one)")
    up.add_argument("--nats-url", default=None, help="use this NATS server instead of starting one")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    up.add_argument("--models-config", default=None, help="YAML/JSON file listing served models")
    up.add_argument(
        "--model",
        action="append",
        type=up_models.parse,
        default=[],
        metavar="[NAME=]SOURCE",
        help="serve this model: a Hugging Face checkpoint directory, a .gguf file or pkg:PACKAGE (repeatable; "
        "beside --models-config's models, if given); the first is the default model",
    )
    up.add_argument("--default-model", default=None)
    up.add_argument("--engine", choices=("continuous", "static"), default="continuous")
    up.add_argument("--max-batch-size", type=int, default=64)
    up.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="step each model's engine in a child process of the inference worker (its own GIL; the default), "
        "or, with --no-engine-process, on a thread of the worker",
    )
    up.add_argument("--inference-replicas", type=int, default=1)
    up.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="start an N-node JetStream cluster on loopback (stream at R3) instead of one server",
    )
    up.add_argument(
        "--nats-sync",
        type=_nats_sync,
        default=NATS_SYNC_DEFAULT,
        metavar="always|DURATION",
        help=f"when the nats-server it starts fsyncs what JetStream acknowledged: 'always' (before the ack) "
        f"or every DURATION, e.g. 2m (default: {NATS_SYNC_DEFAULT}; docs/operations.md, 'Durability')",
    )
    up.add_argument("--state-dir", default=OperatorSettings().state_dir)
    up.add_argument("--ready-timeout", type=float, default=180.0)
    up.add_argument(
        "--no-nats-auth",
        dest="nats_auth",
        action="store_false",
        help="the embedded nats-server takes any local connection (default: per-role users, fresh passwords)",
    )
    sub.add_parser("topology", help="create or update the stream and the durables (NATS_URL, ARENA_NATS_*)")

    run = sub.add_parser("run", help="run one process (settings from ARENA_* variables)")
    run.add_argument("role", choices=topology.role_names())

    for name, helptext in (
        ("replay", "print every event of a request or conversation"),
        ("audit", "check every request reached exactly one terminal event"),
    ):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("--nats-url", default=None)
        sp.add_argument("--state-dir", default=OperatorSettings().state_dir)
        sp.add_argument("--json", action="store_true")
        if name == "replay":
            g = sp.add_mutually_exclusive_group(required=True)
            g.add_argument("--request-id")
            g.add_argument("--conv-id")
            g.add_argument("--battle-id", help="the battle's events and both sides' requests")
        else:
            sp.add_argument("--since", default="1h", help="window, e.g. 30m, 1h, 2d")

    rb = sub.add_parser("rebuild-readmodel", help="refill Redis's results and pending records from the stream")
    rb.add_argument("--since", default="7d", help="window, e.g. 1h, 2d (default: the stream's retention)")
    rb.add_argument("--nats-url", default=None)
    rb.add_argument("--redis-url", default=None)
    rb.add_argument("--state-dir", default=OperatorSettings().state_dir)

    fe = sub.add_parser("filter-eval", help="measure the prompt filter on a labelled JSONL file")
    fe.add_argument("file")
    fe.add_argument("--json", action="store_true")
    fe.add_argument("--classifier", default=None, help="classifier artifact (default: the committed one; 'none')")
    # filter-train's own parser reads its options (see main): listed here for `arena --help`
    sub.add_parser("filter-train", help="train the prompt filter's classifier stage (see --help)", add_help=False)

    mo = sub.add_parser(
        "models",
        help="hot swap: list, add, reload or remove a model on every inference process; "
        "withdraw or reinstate a model in the arena (an event: it stays in the history)",
    )
    mo.add_argument("op", choices=("list", "add", "reload", "remove", "withdraw", "reinstate"))
    mo.add_argument("--name")
    mo.add_argument("--reason", help="withdraw/reinstate: why (recorded on the event)")
    mo.add_argument("--path", help="HF model directory (add; reload with new weights)")
    mo.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (see the models config)")
    mo.add_argument("--device", default="cpu")
    mo.add_argument(
        "--quantize", choices=("int8", "int4"), default=None, help="weight-only quantization (see the models config)"
    )
    mo.add_argument("--wait", type=float, default=30.0, help="seconds to collect answers (loads can be slow)")
    mo.add_argument("--nats-url", default=None)
    mo.add_argument("--json", action="store_true", help="list: each process's answer as a JSON line")
    mo.add_argument("--state-dir", default=OperatorSettings().state_dir)

    lb = sub.add_parser("leaderboard", help="recompute the arena leaderboard from the stream")
    lb.add_argument("--at", type=int, default=None, help="stream sequence to stop at (same digest as then)")
    lb.add_argument("--json", action="store_true")
    lb.add_argument(
        "--style-control", action="store_true", help="ratings with answer length and markdown taken out (LMArena's)"
    )
    lb.add_argument("--category", metavar="NAME", help="the board of one category's votes (coding, math, english, ...)")
    lb.add_argument(
        "--history",
        action="store_true",
        help="every model that ever entered, withdrawn ones included, with its owner and votes; variants per owner",
    )
    ba = sub.add_parser(
        "battles",
        help="import or export arena votes (FastChat clean-battle JSON); invalidate or reinstate a battle's vote",
    )
    ba.add_argument("op", choices=("import", "export", "invalidate", "reinstate"))
    ba.add_argument(
        "file",
        nargs="?",
        metavar="FILE|BATTLE_ID",
        help="import: the file to read; export: the file to write (default stdout); invalidate/reinstate: the battle",
    )
    ba.add_argument("--reason", help="invalidate/reinstate: why (recorded on the event)")
    for sp in (lb, ba):
        sp.add_argument("--nats-url", default=None)
        sp.add_argument("--state-dir", default=OperatorSettings().state_dir)

    tp = sub.add_parser("top", help="live view of a running `arena up`: per model, per durable, per process")
    tp.add_argument("--state-dir", default=OperatorSettings().state_dir)
    tp.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (rates are over it)")
    tp.add_argument("--once", action="store_true", help="print one frame and exit")
    tp.add_argument("--svg", default=None, help="with --once: also save the frame as an SVG screenshot")
    tp.add_argument("--width", type=int, default=120, help="with --once: columns of the frame")

    aa = sub.add_parser("asyncapi", help="write the AsyncAPI document of the event contract")
    aa.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    """`arena`: a command whose reader went away (`arena audit | head`) ends quietly, as
    a Unix tool does, instead of with a BrokenPipeError traceback."""
    try:
        rc = _main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe: point stdout at /dev/null so the interpreter's final
        # flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool ended by a closed pipe
    return rc


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["filter-train"]:
        from consumers.filter.train import main as filter_train  # noqa: PLC0415

        return filter_train(argv[1:])
    args = parser().parse_args(argv)
    if args.cmd == "up":
        return up(up_models.settle(args))
    if args.cmd == "run":
        return run_role(args.role)
    if args.cmd == "topology":
        return asyncio.run(_topology())
    if args.cmd == "replay":
        return asyncio.run(_replay(args))
    if args.cmd == "rebuild-readmodel":
        return asyncio.run(_rebuild(args))
    if args.cmd == "audit":
        return asyncio.run(_audit(args))
    if args.cmd == "filter-eval":
        extra = ["--classifier", args.classifier] if args.classifier else []
        return filter_eval([args.file] + (["--json"] if args.json else []) + extra)
    if args.cmd == "models" and args.op in ("withdraw", "reinstate"):
        return asyncio.run(_arena(args))
    if args.cmd == "models":
        return asyncio.run(_models(args))
    if args.cmd == "asyncapi":
        return _asyncapi(args)
    if args.cmd == "top":
        from infra.monitoring import top  # noqa: PLC0415 - rich stays out of the processes `arena run` starts

        return top.run(args.state_dir, args.interval, args.once, args.svg, args.width)
    if args.cmd in ("leaderboard", "battles"):
        return asyncio.run(_arena(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
