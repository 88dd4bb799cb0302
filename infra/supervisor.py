"""`arena up`: every part of arenaflow on one machine, kept running and stopped in order.

A child that dies is restarted with backoff (logged, and counted in
`arena_process_restarts_total` on the supervisor's metrics port); the others keep
serving. So is a nats-server or redis-server `arena up` started itself: on its port, with
its store (JetStream's files, Redis's append-only file), while the roles reconnect.

A replicated role (inference) has a warm spare beside it, started with the roles:
`arena run inference --standby` imports torch and transformers at a lower priority and
waits. A worker that dies is replaced by promoting it (it loads the models at once)
instead of by a cold process that first spends ~11 s importing; a new spare is started
STANDBY_AFTER_PROMOTION_S later, once the promoted worker has its models in. Which
process is which: `processes.json` in the state dir.

On stop, the roles go down one at a time in the reverse of their start order
(`events.topology.ROLES`): the gateway stops taking requests, inference drains and gives
back what it could not finish while delivery still delivers, and the servers go last.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

import httpx
import nats
import psutil
from prometheus_client import Counter, start_http_server

from consumers.inference.settings import InferenceSettings
from events import topology
from infra import nats_auth, redis_auth, start_checks
from infra.monitoring import scrape
from infra.servers import (
    NATS_SYNC_DEFAULT,
    LocalServer,
    NatsCluster,
    nats_server_config,
    redis_server,
    start_nats,
    start_nats_cluster,
    start_redis,
)
from infra.settings import OperatorSettings
from infra.takeover import Takeover
from infra.up_models import DEFAULT_MODELS_CONFIG, Served
from runtime import children, jetstream
from runtime import models_config as config_file
from runtime.net import free_port
from runtime.settings import CommonSettings

#: What DEFAULT_MODELS_CONFIG serves first, as the file says (runtime.models_config): the
#: model a request that names none gets, and what is loaded before the stack is ready.
_DEFAULT_PLAN = config_file.plan(DEFAULT_MODELS_CONFIG)
DEFAULT_MODEL, DEFAULT_WARM = _DEFAULT_PLAN.default, list(_DEFAULT_PLAN.warm)
RESTARTS = Counter("arena_process_restarts_total", "Children of `arena up` restarted after they died", ["process"])
#: Backoff between restarts of one child: doubles from BACKOFF_MIN_S up to BACKOFF_MAX_S,
#: and starts over once the child has stayed up STABLE_S.
BACKOFF_MIN_S, BACKOFF_MAX_S, STABLE_S = 0.5, 30.0, 60.0
#: A warm spare's priority while it waits (a nice value; its imports take only the CPU the
#: serving processes leave), and how long after a promotion its successor is started (it
#: imports beside the promoted worker's model loads otherwise).
STANDBY_NICE, STANDBY_AFTER_PROMOTION_S = 10, 30.0


def _inherited(env: dict) -> tuple[int, ...]:
    """The listening sockets a child's environment names, which it inherits (pass_fds)."""
    return tuple(int(env[k]) for k in ("ARENA_LISTEN_FD", "ARENA_METRICS_FD") if env.get(k))


def _die_with_parent() -> None:
    """Children get SIGTERM if `arena up` itself dies (even by kill -9)."""
    children.die_with_parent(signal.SIGTERM)


def _standby_preexec() -> None:
    _die_with_parent()
    os.nice(STANDBY_NICE)


def thread_shares(env: dict, replicas: int) -> dict:
    """Each inference replica gets its share of the cores, one left to the gateway, filter,
    delivery and NATS (torch's default takes them all, and then every process fights for
    them), unless ARENA_TORCH_THREADS says otherwise; and its share of every core for a
    step while no other engine of the machine steps (ARENA_TORCH_THREADS_ALONE,
    consumers/inference/runners/cores.py: a model served alone). Where the share is one thread
    (2 cores a replica) a shared step runs no parallel region, so the threads of a step
    alone may spin between its products (libgomp's bounded spin: a second thread waking
    ~200 times a step serves no faster); otherwise torch's OpenMP threads wait passively
    (engines stepping together spin on cores the other needs: docs/operations.md and
    docs/benchmarks.md have the figures, `python -m bench.engine_speed --threads N`); two
    spinning threads in each of an arena battle's two engines starved both, which the
    step notes prevent: engines stepping together run one thread each. A `backend:
    llamacpp` model's server gets the replica's share of every core
    (ARENA_LLAMA_CPP_THREADS) and waits as OpenMP does by default (its server's env)."""
    out: dict[str, str] = {}
    if replicas >= 1:
        cores = os.cpu_count() or 1
        every = str(max(1, cores // replicas))  # the replica's share of every core
        defaults = {
            "ARENA_TORCH_THREADS": str(max(1, (cores - 1) // replicas)),
            "ARENA_TORCH_THREADS_ALONE": every,
            # llama.cpp's threads (OpenMP, its default waiting) leave the core the stack's
            # processes need at each token; on 2 cores two threads served more users faster
            # than one (docs/inference.md, llama.cpp backend).
            "ARENA_LLAMA_CPP_THREADS": every,
        }
        out |= {key: value for key, value in defaults.items() if not env.get(key)}
    shared = int(env.get("ARENA_TORCH_THREADS") or out.get("ARENA_TORCH_THREADS") or 0)
    alone = int(env.get("ARENA_TORCH_THREADS_ALONE") or out.get("ARENA_TORCH_THREADS_ALONE") or 0)
    if not env.get("OMP_WAIT_POLICY") and not (shared == 1 and alone > 1):  # one shared thread: nothing spins beside
        out["OMP_WAIT_POLICY"] = "PASSIVE"
    return out


@dataclass
class Child:
    role: str
    name: str
    env: dict
    proc: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    due: float | None = None  # when a restart is due, while it waits out its backoff


@dataclass
class Standby:
    """A replicated role's warm spare (`arena run ROLE --standby`): none while ``due`` is
    in the future."""

    role: str
    proc: subprocess.Popen | None = None
    due: float = 0.0


@dataclass
class Stack:
    state: Path
    env: dict
    servers: list[LocalServer | NatsCluster] = field(default_factory=list)
    children: dict[str, Child] = field(default_factory=dict)
    takeover: Takeover | None = None  # naks a dead inference process's messages at once
    lock: IO[str] | None = None  # the state dir's lock (infra.start_checks), held until stop() ends
    standbys: dict[str, Standby] = field(default_factory=dict)  # by role; started by supervise()
    #: The gateway's listening socket (infra.start_checks.listen_on), handed to each gateway process.
    listener: socket.socket | None = None
    #: Each child's /metrics socket by name, bound before it starts (Prometheus's target) and
    #: handed to it, its restarts and its role's warm spare (ARENA_METRICS_FD).
    metrics: dict[str, socket.socket] = field(default_factory=dict)
    _roster: dict = field(default_factory=dict)  # as processes.json says it

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {name: c.proc for name, c in self.children.items()}

    def _popen(self, role: str, name: str, env: dict) -> subprocess.Popen:
        listener = self.listener if role == topology.GATEWAY.name else None
        if listener is not None:  # the socket it serves, and which descriptor it is
            env = {**env, "ARENA_LISTEN_FD": str(listener.fileno())}
        with open(self.state / "logs" / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "infra.cli", "run", role],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only sets PDEATHSIG; no threads run yet
                pass_fds=_inherited(env),
            )

    def metrics_socket(self, name: str, host: str) -> socket.socket:
        """A /metrics socket for the child ``name``, bound and listening now (a free port on ``host``)."""
        sock = self.metrics[name] = start_checks.listen_on(host, 0)
        return sock

    def spawn(self, role: str, name: str | None = None, extra_env: dict | None = None) -> subprocess.Popen:
        name = name or role
        env = {**self.env, **(extra_env or {})}
        self.children[name] = Child(role, name, env, self._popen(role, name, env))
        return self.children[name].proc

    def supervise(self, say=print) -> None:
        """Restart children and the servers this stack started that died, with backoff
        (a child of a role with a warm spare: by promoting the spare); start the spares
        that are due; call it periodically."""
        now = time.monotonic()
        for child in self.children.values():
            self._revive(child.name, child, functools.partial(self._restart, child, say), now, say)
        for name, server in self._local_servers():
            self._revive(name, server, server.respawn, now, say)
        for standby in self.standbys.values():
            self._keep_standby(standby, now, say)
        self.write_roster()

    def roster(self) -> dict:
        """Which process is which: each child's pid by name, each role's warm spare (a
        promoted spare keeps its `--standby` command line; this says what it runs as)."""
        return {
            "children": {name: c.proc.pid for name, c in self.children.items() if c.due is None},
            "standbys": {role: s.proc.pid if s.proc is not None else None for role, s in self.standbys.items()},
        }

    def write_roster(self) -> None:
        """`processes.json` in the state dir, when the roster changed (for operators and the tests)."""
        roster = self.roster()
        if roster != self._roster:
            self._roster = roster
            path = self.state / "processes.json"
            path.with_suffix(".tmp").write_text(json.dumps(roster))
            path.with_suffix(".tmp").replace(path)

    def _restart(self, child: Child, say) -> subprocess.Popen:
        """A process for ``child``: its role's warm spare, promoted, if one is there; else a new one."""
        standby = self.standbys.get(child.role)
        if standby is not None and standby.proc is not None:
            spare, standby.proc = standby.proc, None
            standby.due = time.monotonic() + STANDBY_AFTER_PROMOTION_S
            if self.promote(spare, child):
                say(json.dumps({"event": "standby_promoted", "process": child.name, "pid": spare.pid}), flush=True)
                return spare
            _terminate([spare], 1.0)
        return self._popen(child.role, child.name, child.env)

    def promote(self, spare: subprocess.Popen, child: Child) -> bool:
        """Tell ``spare`` to run as ``child`` (its environment, log file and this process's
        priority: see infra.commands.run.promoted); False if it is gone."""
        order = {"env": child.env, "log": str(self.state / "logs" / f"{child.name}.log"), "nice": os.nice(0)}
        assert spare.stdin is not None
        try:
            spare.stdin.write(json.dumps(order).encode() + b"\n")
            spare.stdin.close()
        except OSError:
            return False
        return spare.poll() is None

    def _keep_standby(self, standby: Standby, now: float, say) -> None:
        """Start ``standby``'s spare when it is due and none is there (a spare that died on
        its own is started again after STANDBY_AFTER_PROMOTION_S)."""
        if standby.proc is not None and standby.proc.poll() is not None:
            say(
                json.dumps({"event": "standby_exited", "role": standby.role, "code": standby.proc.returncode}),
                flush=True,
            )
            standby.proc, standby.due = None, now + STANDBY_AFTER_PROMOTION_S
        if standby.proc is not None or now < standby.due:
            return
        env = next((c.env for c in self.children.values() if c.role == standby.role), self.env)
        # It may replace any of the role's processes: it holds each one's /metrics socket, and
        # serves the one its promotion's environment names.
        sockets = {fd for c in self.children.values() if c.role == standby.role for fd in _inherited(c.env)}
        with open(self.state / "logs" / f"{standby.role}-standby.log", "ab") as log:
            standby.proc = subprocess.Popen(
                [sys.executable, "-m", "infra.cli", "run", standby.role, "--standby"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_standby_preexec,  # noqa: PLW1509 - PDEATHSIG and a nice value; no threads run yet
                pass_fds=tuple(sorted(sockets)),
            )

    def _local_servers(self) -> list[tuple[str, LocalServer]]:
        out: list[tuple[str, LocalServer]] = []
        for server in self.servers:
            if isinstance(server, NatsCluster):
                out += [(f"nats-server-{n.name}", s) for n, s in zip(server.nodes, server.servers, strict=True)]
            else:
                out.append((f"{server.name}-server", server))
        return out

    def _revive(self, name: str, it: Child | LocalServer, start, now: float, say) -> None:
        """Restart ``it`` (a role's process or a server) if it died, once its backoff is over."""
        if it.due is not None:
            if now >= it.due:
                it.proc, it.started, it.due = start(), now, None
            return
        code = it.proc.poll()
        if code is None:
            return
        if now - it.started >= STABLE_S:
            it.restarts = 0
        handed_on = self.takeover.release(it.proc.pid) if self.takeover and isinstance(it, Child) else 0
        delay = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2**it.restarts)
        it.restarts += 1
        it.due = now + delay
        RESTARTS.labels(name).inc()
        say(
            json.dumps(
                {
                    "event": "process_exited",
                    "process": name,
                    "code": code,
                    "restart_in_s": delay,
                    "restarts": it.restarts,
                    "messages_handed_on": handed_on,
                }
            ),
            flush=True,
        )

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the spares, the roles one at a time in the reverse of their start order, then the servers."""
        _terminate([s.proc for s in self.standbys.values() if s.proc is not None], grace_s)
        if self.listener is not None:
            self.listener.close()  # the gateway's copy alone: closed as it drains, refusing newcomers
        for role in reversed(topology.role_names()):
            _terminate([c.proc for c in self.children.values() if c.role == role], grace_s)
        if self.takeover is not None:
            with contextlib.suppress(Exception):
                self.takeover.close()
        for sock in self.metrics.values():
            sock.close()
        for server in reversed(self.servers):
            server.stop()
        if self.lock is not None:
            self.lock.close()  # the state dir is free for the next `arena up`


def _terminate(procs: list[subprocess.Popen], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_stack(args, served: Served, print_fn=print) -> tuple[Stack, str]:
    """Start what `arena up` runs, in order: NATS (unless --nats-url), Redis (unless
    --redis-url), every role's processes, the supervisor's metrics; then write where
    each answers (`endpoints.json`) for the operator commands."""
    state = Path(args.state_dir).resolve()
    lock = start_checks.hold_state_dir(state)  # before anything else: a refused start touches nothing
    listener = start_checks.listen_on(args.host, args.port if args.port is not None else 8000)
    port = listener.getsockname()[1]
    (state / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    stack = Stack(state, env, lock=lock, listener=listener)
    try:
        return _start(stack, args, served, port, print_fn)
    except BaseException:
        stack.stop(grace_s=5.0)  # what did start (nats-server, redis-server, roles), and the state dir's lock
        raise


def _start(stack: Stack, args, served: Served, port: int, print_fn) -> tuple[Stack, str]:
    state, env = stack.state, stack.env
    operator = OperatorSettings()
    nats_at = _nats(stack, args, args.nats_url or operator.nats_url, print_fn)
    stack.takeover = _takeover(nats_at.operator_url, operator) if nats_at.operator_url else None
    redis_at = _redis(stack, args.redis_url or operator.redis_url, print_fn)
    env.update(_role_env(args, served, port, nats_at.url, redis_at.url, env))
    print_fn(
        f"models: {served.config}; default model {served.plan.default}; warming "
        f"{', '.join(json.loads(env['ARENA_WARM_MODELS']))} (the others load on their first request)"
    )
    convert_sources(str(served.config), env, print_fn)
    targets = _spawn_roles(stack, args.inference_replicas, nats_at.credentials, redis_at.users)
    if getattr(args, "standby", True) and args.inference_replicas >= 1:
        # Started with the roles, at its lower priority: imported by the time they are ready.
        stack.standbys[topology.INFERENCE.name] = standby = Standby(topology.INFERENCE.name)
        stack._keep_standby(standby, time.monotonic(), print_fn)
    stack.write_roster()
    metrics_port = _serve_metrics(stack, targets, print_fn)
    url = f"http://{args.host}:{port}"
    _private_file(
        state / "endpoints.json",
        json.dumps(
            {
                # The operator's URLs (with their credentials when the servers have users): what
                # `arena replay`, `audit`, `models` and `rebuild-readmodel` connect with.
                "nats_url": nats_at.operator_url,
                "redis_url": redis_at.users.get(redis_auth.OPERATOR, redis_at.url),
                "gateway_url": url,
                "pid": os.getpid(),
                "supervisor_metrics_port": metrics_port,
            }
        ),
    )
    return stack, url


@dataclass
class _Endpoint:
    """A server the roles use: its URL, and its per-role credentials when `arena up` started it."""

    url: str
    operator_url: str | None = None
    credentials: dict[str, str] = field(default_factory=dict)  # NATS: each role's password
    users: dict[str, str] = field(default_factory=dict)  # Redis: each user's URL


def _nats(stack: Stack, args, url: str | None, print_fn) -> _Endpoint:
    """The NATS server given, else one (or a cluster) started here, with per-role users
    (unless --no-nats-auth) and the stream and durables created by the operator."""
    if url:
        return _Endpoint(url, operator_url=url)
    state = stack.state
    credentials: dict[str, str] = {}
    auth = None
    if getattr(args, "nats_auth", True):
        credentials = nats_auth.new_passwords()  # per run: a local process without them cannot connect
        auth = _private_file(state / "nats-auth.conf", nats_auth.server_config(credentials)).name
    sync = getattr(args, "nats_sync", None) or NATS_SYNC_DEFAULT
    config = _private_file(state / "nats-server.conf", nats_server_config(sync, include=auth))
    nodes = getattr(args, "nats_cluster", 1) or 1
    if nodes > 1:
        cluster = start_nats_cluster(state / "nats-cluster", nodes, log_dir=state / "logs", config=config)
        stack.servers.append(cluster)
        url = operator_url = cluster.url
        stack.env["ARENA_STREAM_REPLICAS"] = str(min(3, nodes))
        where = f"a {nodes}-node cluster, stream at R{min(3, nodes)}, stores in {state / 'nats-cluster'}"
    else:
        server = start_nats(state / "nats", log_file=state / "logs" / "nats-server.log", config=config)
        stack.servers.append(server)
        url = operator_url = server.url
        where = f"store {state / 'nats'}"
    if credentials:
        operator_url = ",".join(
            with_credentials(u, nats_auth.OPERATOR, credentials[nats_auth.OPERATOR]) for u in jetstream.servers(url)
        )
        # the roles may not create it: they wait for it
        asyncio.run(create_topology(operator_url, int(stack.env.get("ARENA_STREAM_REPLICAS", "1"))))
    print_fn(
        f"nats-server (JetStream) on {url}, {where}, per-role users: {bool(credentials)}, "
        f"fsync: {sync if sync == 'always' else 'every ' + sync}"
    )
    return _Endpoint(url, operator_url, credentials=credentials)


def _redis(stack: Stack, url: str | None, print_fn) -> _Endpoint:
    """The Redis given, else one started here with a user per role."""
    if url:
        return _Endpoint(url)
    state = stack.state
    passwords = redis_auth.new_passwords()  # per run, as NATS's: anonymous clients are refused
    acl = _private_file(state / "redis-users.acl", redis_auth.acl_file(passwords))  # a restart reads it again
    server = start_redis(state / "redis", log_file=state / "logs" / "redis-server.log", acl=acl)
    stack.servers.append(server)
    print_fn(
        f"redis-server {redis_server()} on {server.url} (append-only file in {state / 'redis'}), per-role users: True"
    )
    return _Endpoint(server.url, users=redis_auth.urls(server.url, passwords))


def _role_env(args, served: Served, port: int, nats_url: str, redis_url: str, base: dict) -> dict[str, str]:
    """What every role reads from `arena up`'s flags (ARENA_* variables) over the `base`
    environment, and what it serves (`served`, as infra.up_models.settle chose it)."""
    env = {
        "NATS_URL": nats_url,
        "REDIS_URL": redis_url,
        "ARENA_PORT": str(port),
        "ARENA_HOST": args.host,
        "ARENA_ENGINE": args.engine,
        "ARENA_MAX_BATCH_SIZE": str(args.max_batch_size),
    }
    if getattr(args, "engine_process", None) is not None:  # else ARENA_ENGINE_PROCESS, or the default (a process)
        env["ARENA_ENGINE_PROCESS"] = "1" if args.engine_process else "0"
    return env | served.env(base)


def _spawn_roles(
    stack: Stack, inference_replicas: int, credentials: dict[str, str], redis_users: dict[str, str]
) -> list[scrape.Target]:
    """Every role's processes (`inference_replicas` of the replicated one), each with its
    NATS and Redis user and a metrics port of its own; their scrape targets."""
    targets: list[scrape.Target] = []
    for role in topology.ROLES:
        replicas = inference_replicas if role.replicated else 1
        extra = thread_shares(stack.env, replicas) if role.replicated else {}
        if credentials:
            extra |= {
                "ARENA_NATS_USER": role.name,
                "ARENA_NATS_PASSWORD": credentials[role.name],
                "ARENA_MANAGE_TOPOLOGY": "false",
            }
        if redis_users:
            extra["REDIS_URL"] = redis_users[role.name]
        for i in range(replicas):
            name = f"{role.name}-{i}" if role.replicated else role.name
            # A port of its own, bound here before it starts and held across its restarts:
            # Prometheus finds it, and no other server takes it meanwhile. The gateway's too (on
            # ARENA_HTTP_HOST, 127.0.0.1 by default, whatever --host says): its API port wants
            # a key when ARENA_API_KEYS is set, its metrics port none.
            metrics = stack.metrics_socket(name, stack.env.get("ARENA_HTTP_HOST") or "127.0.0.1")
            port = metrics.getsockname()[1]
            targets.append(scrape.Target(name, role.name, port))
            stack.spawn(
                role.name, name, extra | {"ARENA_METRICS_FD": str(metrics.fileno()), "ARENA_METRICS_PORT": str(port)}
            )
    return targets


def _serve_metrics(stack: Stack, targets: list[scrape.Target], print_fn) -> int:
    """The supervisor's own /metrics (restarts), and a Prometheus scrape config of every target; its port."""
    metrics_port = free_port()
    for name in [*stack.children, *(name for name, _ in stack._local_servers())]:
        RESTARTS.labels(name)  # at 0 from the start: increase() then counts the first restart
    start_http_server(metrics_port, addr="127.0.0.1")
    targets = [*targets, scrape.Target("supervisor", "supervisor", metrics_port)]
    prometheus = scrape.write(stack.state / "prometheus", targets)
    print_fn(f"Prometheus scrape config: prometheus --config.file {prometheus}")
    return metrics_port


def convert_sources(models_config: str, env: dict, print_fn=print) -> None:
    """The config's GGUF sources converted before the workers start (infra.convert_sources),
    in a child process whose lines are passed on: the supervisor never imports torch."""
    command = [sys.executable, "-m", "infra.convert_sources", models_config]
    # Its stderr (the conversion's progress bars) goes to this process's own.
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None
        for line in child.stdout:
            print_fn(line.rstrip("\n"))
    if child.returncode:  # killed, or failed before it could say why: the workers convert what is left
        print_fn(
            f"converting the model sources failed (exit code {child.returncode}, its error above); "
            "each worker converts what it needs as it loads, and a model that cannot be converted fails naming why"
        )


def _takeover(url: str, operator: OperatorSettings) -> Takeover | None:
    """The dead-worker hand-on (see infra.takeover); without it, AckWait still moves the
    work on, only later."""
    try:
        return Takeover(url, **jetstream.connect_options(operator))
    except Exception as exc:  # noqa: BLE001 - any failure to connect only turns the hand-on off
        print(f"dead-worker hand-on off (NATS: {exc!r}); held work moves on after its AckWait", file=sys.stderr)
        return None


def _private_file(path: Path, text: str) -> Path:
    """Written readable by this user only (it may hold credentials)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def with_credentials(url: str, user: str, password: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


async def create_topology(url: str, replicas: int = 1) -> None:
    """The stream and the durables, created by the operator before any role starts."""
    settings = CommonSettings()
    nc = await nats.connect(jetstream.servers(url), connect_timeout=5, allow_reconnect=False)
    try:
        await jetstream.ensure_topology(
            nc.jetstream(), settings.retention_days, **{**settings.topology(), "replicas": replicas}
        )
    finally:
        await nc.close()


def wait_ready(stack: Stack, url: str, timeout: float, print_fn=print) -> bool:
    """Wait for /readyz from this stack's own gateway (another server on its port does
    not count); a child that exits before the stack is ready fails the start."""
    start = time.monotonic()
    end = start + timeout
    last, said = "", start
    port = urlparse(url).port
    while time.monotonic() < end:
        for name, proc in stack.procs.items():
            if proc.poll() is not None:
                log = stack.state / "logs" / f"{name}.log"
                print_fn(f"{name} exited with {proc.returncode}: {_exit_reason(log)}\n(see {log})")
                return False
        try:
            r = httpx.get(f"{url}/readyz", timeout=1.0)
            body = r.json()
            if r.status_code == 200 and _own_gateway_listens(stack, port):
                return True
            line = waiting_line(body, json.loads(stack.env.get("ARENA_WARM_MODELS") or "[]"))
        except (httpx.HTTPError, ValueError):
            line = "waiting: gateway starting"
        now = time.monotonic()
        if line != last or now - said >= 10:  # what changed, and a sign of life while a model loads
            print_fn(f"{line} ({now - start:.0f} s)")
            last, said = line, now
        time.sleep(0.3)
    print_fn(f"not ready after {timeout}s")
    return False


def waiting_line(ready: dict, warm: list[str] | None = None) -> str:
    """What `arena up` says while the stack starts, from the gateway's /readyz: the ready
    processes per role, and each model warmed at start (else each the workers list) as
    loading or resident, once a worker lists them."""
    counts = " ".join(f"{role}={ready.get(role)}" for role in topology.required())
    models = ready.get("models", {})
    shown = [name for name in warm or models if name in models]
    states = ", ".join(f"{name} {'resident' if models[name] else 'loading'}" for name in shown)
    if warm:
        later = len(set(models) - set(warm))
        return f"waiting: {counts}; warming: {states or ', '.join(warm) + ' (no worker lists them yet)'}" + (
            f"; {later} more load on their first request" if later else ""
        )
    return f"waiting: {counts}; models: {states or 'none listed yet'}"


def _own_gateway_listens(stack: Stack, port: int | None) -> bool:
    """A gateway process of this stack listens on `port` (what answered is not some
    other server that held the port first)."""
    for child in stack.children.values():
        if child.role != topology.GATEWAY.name:
            continue
        with contextlib.suppress(psutil.Error):
            for conn in psutil.Process(child.proc.pid).net_connections("tcp"):
                if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                    return True
    return False


def _exit_reason(log: Path) -> str:
    """Why a process exited, from its log: its last error (uvicorn logs a failed bind, then
    its shutdown), else its last line (a traceback's)."""
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        with contextlib.suppress(ValueError, AttributeError):
            entry = json.loads(line)
            if entry.get("level") in ("ERROR", "CRITICAL"):
                return str(entry.get("msg"))[:500]
    return lines[-1][-500:] if lines else "nothing logged"


def up(args, served: Served) -> int:
    stopping = {"flag": False}

    def on_signal(signum, _frame):
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack, url = start_stack(args, served)
    except (start_checks.StartRefused, RuntimeError, OSError) as exc:  # what started is stopped by then
        print(f"arena up: {exc}", file=sys.stderr)
        return 1
    drain = InferenceSettings().drain_grace_s
    try:
        if not wait_ready(stack, url, args.ready_timeout):
            if not stopping["flag"]:
                print(f"arena up did not start; logs in {stack.state / 'logs'}", file=sys.stderr)
                return 1
            return 0
        print(f"arenaflow ready at {url}  (OpenAI base_url {url}/v1; logs in {stack.state / 'logs'})", flush=True)
        while not stopping["flag"]:
            stack.supervise()
            time.sleep(0.2)
        return 0
    finally:
        print("stopping arenaflow...", flush=True)
        stack.stop(grace_s=drain + 5.0)
        print("stopped", flush=True)
