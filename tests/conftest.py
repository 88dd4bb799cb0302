"""Fixtures: real, isolated nats-server and redis-server processes, and the whole stack."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engines started in this process keep their step figures for this run only (not the
# developer's earlier runs'); `arena up` stacks (tests.arena_up) use the user's default.
os.environ.setdefault("ARENA_STEP_FIGURES_DIR", tempfile.mkdtemp(prefix="arena-step-figures-"))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K-hf"
#: Prompts in the style stories260K was trained on.
STORY_PROMPTS = [
    "Once upon a time",
    "The little cat",
    "Tom had a red ball",
    "One day, a bird",
    "Lily went to the park",
    "The sun was hot",
    "A big dog ran",
    "Mom said",
]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from events.topology import role_names  # noqa: E402
from infra.supervisor import Stack, thread_shares  # noqa: E402
from runtime import jetstream  # noqa: E402
from runtime.net import free_port  # noqa: E402
from tests.servers import nats_for_tests, redis_for_tests  # noqa: E402
from tests.waiting import until  # noqa: E402, F401  (tests import it from here too)

ROLES = tuple(role_names())


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_runtest_setup(item):
    """A run stopped with SIGTERM (`kill`, a CI timeout) tears its fixtures down as Ctrl-C does:
    otherwise the nats-server and redis-server processes it started outlive it. Set before every
    test, because a test of a process's own SIGTERM handling (asyncio's) leaves the default."""
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e and tests/integration runs real servers: the
    `integration` tier. `pytest -m "not integration"` is the fast tier."""
    for item in items:
        parts = Path(str(item.fspath)).parts
        if "e2e" in parts or "integration" in parts:
            item.add_marker(pytest.mark.integration)


@contextmanager
def in_memory_traces():
    """Tracing on in this process, into the OpenTelemetry SDK's in-memory exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from runtime import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.install(None)


def stored_events(nats_url: str, request_id: str) -> list:
    """A request's events as the stream holds them (what `arena replay` prints)."""

    import nats

    from runtime.stream import request_events

    async def go():
        nc = await nats.connect(jetstream.servers(nats_url))
        try:
            for attempt in range(4):
                try:
                    return await request_events(nc.jetstream(), request_id)
                except nats.errors.TimeoutError:  # a cluster electing a new JetStream leader
                    if attempt == 3:
                        raise
                    await asyncio.sleep(1.0)
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.fixture
def nats_server(tmp_path):
    server = nats_for_tests(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path):
    server = redis_for_tests(tmp_path / "redis")
    yield server
    server.stop()


def stack_env(nats_url: str, redis_url: str, port: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_")}
    env.update(
        {
            "NATS_URL": nats_url,
            "REDIS_URL": redis_url,
            "ARENA_PORT": str(port),
            "ARENA_MODELS_DIR": str(SHARED / "models"),
            "HF_HUB_OFFLINE": "1",
            "ARENA_HEARTBEAT_S": "0.5",
            "ARENA_LOG_LEVEL": "INFO",
        }
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


class RunningStack:
    def __init__(self, tmp: Path, nats, redis, **extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.nats, self.redis = nats, redis
        # A fixed metrics port is the inference process's alone (each process has its own).
        self.inference_env = {k: str(extra.pop(k)) for k in ("ARENA_METRICS_PORT",) if k in extra}
        self.stack = Stack(tmp, stack_env(nats.url, redis.url, self.port, **extra))
        self.inference_env |= thread_shares(self.stack.env, 1)  # arena up's share of the cores
        (tmp / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, roles=ROLES, timeout: float = 90.0) -> RunningStack:
        for role in roles:
            self.stack.spawn(role, extra_env=self.inference_env if role == "inference" else None)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, proc in self.stack.procs.items():
                if proc.poll() is not None and name in ROLES:
                    raise RuntimeError(f"{name} exited: {self.log(name)[-3000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("stack not ready: " + " | ".join(self.log(n)[-1500:] for n in self.stack.procs))

    def log(self, name: str) -> str:
        path = self.stack.state / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        self.stack.stop()


class StackSet:
    """Stacks sharing one nats-server and redis-server, all stopped together."""

    def __init__(self, tmp: Path, nats, redis):
        self.tmp, self.nats, self.redis = tmp, nats, redis
        self.stacks: list[RunningStack] = []

    def make(self, **extra) -> RunningStack:
        s = RunningStack(self.tmp / f"stack{len(self.stacks)}", self.nats, self.redis, **extra)
        self.stacks.append(s)
        return s

    def stop(self) -> None:
        for s in self.stacks:
            s.stop()


@pytest.fixture
def stack_factory(tmp_path, nats_server, redis_server):
    stacks = StackSet(tmp_path, nats_server, redis_server)
    yield stacks.make
    stacks.stop()


@pytest.fixture
def stack(stack_factory):
    return stack_factory().start()


@pytest.fixture(scope="module")
def module_stack_factory(tmp_path_factory):
    """Like stack_factory, but one nats/redis pair and stacks shared by a whole module."""
    tmp = tmp_path_factory.mktemp("modstack")
    nats_srv, redis_srv = nats_for_tests(tmp / "nats"), redis_for_tests(tmp / "redis")
    stacks = StackSet(tmp, nats_srv, redis_srv)
    yield stacks.make
    stacks.stop()
    nats_srv.stop()
    redis_srv.stop()


def ask(url: str, content: str, **fields) -> dict:
    """One greedy chat turn to the stack (its default model unless `model` is given): the 200's body."""
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "temperature": 0, **fields},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()
