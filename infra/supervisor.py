"""`arena up`: every part of arenaflow on one machine, started and stopped together."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infra.servers import LocalServer, free_port, start_nats, start_redis

ROLES = ("filter", "delivery", "inference", "gateway")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Children get SIGTERM if `arena up` itself dies (even by kill -9)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Stack:
    state: Path
    env: dict
    servers: list[LocalServer] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def spawn(self, role: str, name: str | None = None, extra_env: dict | None = None) -> subprocess.Popen:
        name = name or role
        log = open(self.state / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "infra.cli", "run", role],
            env={**self.env, **(extra_env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        self.procs[name] = proc
        return proc

    def stop(self, grace_s: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for server in self.servers:
            server.stop()


def start_stack(args, print_fn=print) -> Stack:
    state = Path(args.state_dir).resolve()
    (state / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    stack = Stack(state, env)
    nats_url = args.nats_url or os.environ.get("NATS_URL")
    redis_url = args.redis_url or os.environ.get("REDIS_URL")
    if not nats_url:
        server = start_nats(state / "nats", log_file=state / "logs" / "nats-server.log")
        stack.servers.append(server)
        nats_url = server.url
        print_fn(f"nats-server (JetStream) on {nats_url}, store {state / 'nats'}")
    if not redis_url:
        server = start_redis(state / "redis", log_file=state / "logs" / "redis-server.log")
        stack.servers.append(server)
        redis_url = server.url
        print_fn(f"redis-server on {redis_url}")
    port = args.port if args.port is not None else 8000
    if port == 0:
        port = free_port()
    env.update(
        {
            "NATS_URL": nats_url,
            "REDIS_URL": redis_url,
            "ARENA_PORT": str(port),
            "ARENA_HOST": args.host,
            "ARENA_ENGINE": args.engine,
            "ARENA_MAX_BATCH_SIZE": str(args.max_batch_size),
        }
    )
    if args.models_config:
        env["ARENA_MODELS_CONFIG"] = str(Path(args.models_config).resolve())
    if args.default_model:
        env["ARENA_DEFAULT_MODEL"] = args.default_model
    for role in ROLES:
        for i in range(args.inference_replicas if role == "inference" else 1):
            stack.spawn(role, f"{role}-{i}" if role == "inference" else role)
    url = f"http://{args.host}:{port}"
    (state / "endpoints.json").write_text(
        json.dumps({"nats_url": nats_url, "redis_url": redis_url, "gateway_url": url, "pid": os.getpid()})
    )
    return stack, url


def wait_ready(stack: Stack, url: str, timeout: float, print_fn=print) -> bool:
    end = time.monotonic() + timeout
    last = ""
    while time.monotonic() < end:
        for name, proc in stack.procs.items():
            if proc.poll() is not None:
                print_fn(f"{name} exited with {proc.returncode}; see {stack.state / 'logs' / (name + '.log')}")
                return False
        try:
            r = httpx.get(f"{url}/readyz", timeout=1.0)
            body = r.json()
            if r.status_code == 200:
                return True
            line = (
                f"waiting: filter={body.get('filter')} inference={body.get('inference')} "
                f"delivery={body.get('delivery')} models={list(body.get('models', {}))}"
            )
        except (httpx.HTTPError, ValueError):
            line = "waiting: gateway starting"
        if line != last:
            print_fn(line)
            last = line
        time.sleep(0.3)
    return False


def up(args) -> int:
    stopping = {"flag": False}

    def on_signal(signum, _frame):
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack, url = start_stack(args)
    try:
        if not wait_ready(stack, url, args.ready_timeout):
            if not stopping["flag"]:
                print(f"not ready after {args.ready_timeout}s; logs in {stack.state / 'logs'}", file=sys.stderr)
                return 1
            return 0
        print(f"arenaflow ready at {url}  (OpenAI base_url {url}/v1; logs in {stack.state / 'logs'})", flush=True)
        while not stopping["flag"]:
            for name, proc in stack.procs.items():
                if proc.poll() is not None:
                    print(f"{name} exited with {proc.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        print("stopping arenaflow...", flush=True)
        stack.stop()
        print("stopped", flush=True)
