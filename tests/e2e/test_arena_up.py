"""`arena up` as a user runs it: one command up, a request, replay, audit, and a clean stop."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import psutil
import pytest

from tests.arena_up import ArenaUp, arena, user_env
from tests.conftest import REPO, ask
from tests.integration.test_nats_sync import varz_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_up_serves_replays_audits_and_stops_cleanly(tmp_path):
    up = ArenaUp(tmp_path, ready_s=150)
    state, env, url = up.state, up.env, up.url
    try:
        children = psutil.Process(up.proc.pid).children(recursive=True)
        assert len(children) >= 6  # nats, redis, filter, delivery, inference, gateway

        r = httpx.post(
            f"{url}/v1/chat/completions",
            timeout=30,
            json={
                "model": "stories-260k",
                "max_tokens": 12,
                "temperature": 0,
                "messages": [{"role": "user", "content": "Once upon a time"}],
            },
        )
        assert r.status_code == 200, r.text
        rid = r.json()["x_arena"]["request_id"]

        replay = arena("replay", "--request-id", rid, "--state-dir", str(state), env=env)
        assert replay.returncode == 0, replay.stderr
        kinds = [line.split()[1] for line in replay.stdout.splitlines()]
        assert kinds[0] == "chat.requested" and kinds[-1] == "chat.completed"
        assert "tokens.generated" in kinds

        audit = arena("audit", "--since", "1h", "--state-dir", str(state), "--json", env=env)
        report = json.loads(audit.stdout)
        assert audit.returncode == 0 and report["ok"] and report["requests"] == 1
    finally:
        code = up.stop()
    assert code == 0
    left = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"left processes behind: {[(c.pid, c.cmdline()) for c in left]}"

    # The stream outlives the stack: replay reads the store it left.
    again = arena("replay", "--request-id", rid, "--state-dir", str(state), env=env)
    assert again.returncode == 0 and "chat.completed" in again.stdout


# ---- one stack per state dir, and a "ready" that is the stack's own ----------------------


class Ready(BaseHTTPRequestHandler):
    """Another server on the port, answering /readyz 200 as a ready gateway would."""

    def do_GET(self) -> None:
        body = json.dumps({"ready": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def other_server(port: int = 0):
    server = ThreadingHTTPServer(("127.0.0.1", port), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def arena_up(state, port: int, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "infra.cli", "up", "--port", str(port), "--state-dir", str(state)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    """Its exit code, all it printed and how long it ran (killed, and failed, if it runs on)."""
    start = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"arena up still running after {timeout}s:\n{out}")
    return proc.returncode, out, time.monotonic() - start


def test_a_second_arena_up_in_the_same_state_dir_is_refused_and_the_first_still_operates(tmp_path):
    up = ArenaUp(tmp_path)
    try:
        # What a second stack would rewrite (the stores are the first stack's servers' to write).
        kept = {p: p.read_bytes() for p in up.state.rglob("*") if p.is_file() and not _store_or_log(up.state, p)}
        mtimes = {p: p.stat().st_mtime_ns for p in kept}
        servers = _servers_on(up.state)
        assert len(servers) == 2, servers

        code, out, seconds = finished(arena_up(up.state, 0, up.env), timeout=30)
        assert code != 0, out
        assert f"in use by another `arena up` (pid {up.proc.pid})" in out, out
        assert "ready at" not in out and "nats-server" not in out, out
        print(f"\n[second arena up] refused in {seconds:.1f}s: {out.strip()}")

        # Nothing of the first stack's was touched: its config and endpoints, and no second
        # server was started on its stores.
        assert {p: p.stat().st_mtime_ns for p in kept} == mtimes
        assert {p: p.read_bytes() for p in kept} == kept
        assert _servers_on(up.state) == servers
        models = arena("models", "list", "--state-dir", str(up.state), env=up.env)
        assert models.returncode == 0, models.stdout + models.stderr
        r = httpx.post(
            f"{up.url}/v1/chat/completions",
            timeout=30,
            json={"max_tokens": 4, "messages": [{"role": "user", "content": "Once upon a time"}]},
        )
        assert r.status_code == 200, r.text
    finally:
        assert up.stop() == 0
    # Stopped, it frees the dir: the next `arena up` there starts.
    again = ArenaUp(tmp_path)
    assert again.stop() == 0


def _store_or_log(state, path) -> bool:
    return path.relative_to(state).parts[0] in ("nats", "redis", "logs")


def _servers_on(state) -> set[int]:
    """nats-server and redis-server processes with their store in `state` (redis-server
    rewrites its command line, but works in its --dir)."""
    out = set()
    for p in psutil.process_iter(["name", "cmdline", "cwd"]):
        where = " ".join([*(p.info["cmdline"] or []), p.info["cwd"] or ""])
        if p.info["name"] in ("nats-server", "redis-server") and str(state) in where:
            out.add(p.pid)
    return out


def test_arena_up_on_a_taken_port_fails_fast_and_starts_nothing(tmp_path):
    with other_server() as port:
        code, out, seconds = finished(arena_up(tmp_path / "state", port, user_env()), timeout=30)
    assert code != 0 and "ready at" not in out, out
    assert f"port {port} on 127.0.0.1: address already in use" in out, out
    assert not (tmp_path / "state" / "nats").exists(), "it started nats-server before it checked the port"
    print(f"\n[taken port] refused in {seconds:.1f}s: {out.strip()}")


def test_the_port_is_the_stacks_from_its_check_on_and_across_a_gateway_restart(tmp_path):
    """`arena up` binds the port as it checks it and hands the socket to its gateway: no
    other server takes it while the stack starts (an `--port 0` start could lose its
    port to one before), and while a killed gateway restarts a client's connection waits
    in the backlog and is answered by the new one instead of being refused (nor told that
    no worker is connected before the new gateway heard the workers' heartbeats)."""
    proc = arena_up(tmp_path / "state", 0, user_env())
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        while not lines or not lines[-1].startswith("Prometheus scrape config"):  # the roles are starting
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)
        endpoints = tmp_path / "state" / "endpoints.json"
        end = time.monotonic() + 10
        while not endpoints.exists() and time.monotonic() < end:
            time.sleep(0.05)
        port = json.loads(endpoints.read_text())["gateway_url"].rsplit(":", 1)[1]
        with pytest.raises(OSError, match="in use"), other_server(int(port)):
            pass
        # So is each process's /metrics port, the one Prometheus is told to scrape.
        targets = json.loads((tmp_path / "state" / "prometheus" / "targets.json").read_text())
        scraped = {t["labels"]["process"]: int(t["targets"][0].rsplit(":", 1)[1]) for t in targets}
        for name in ("gateway", "filter", "delivery"):
            with pytest.raises(OSError, match="in use"), other_server(scraped[name]):
                pass
        while "ready at" not in lines[-1]:
            lines.append(proc.stdout.readline())
            assert lines[-1], "".join(lines)
        url = f"http://127.0.0.1:{port}"
        gateway = json.loads((tmp_path / "state" / "processes.json").read_text())["children"]["gateway"]
        os.kill(gateway, signal.SIGKILL)
        started = time.monotonic()
        body = ask(url, "Once upon a time", max_tokens=8)
        assert body["choices"][0]["message"]["content"] and _own_gateway_answered(tmp_path / "state", gateway)
        print(f"\n[gateway kill -9] a chat request sent at once answered after {time.monotonic() - started:.1f} s")
        # The new gateway and a restarted delivery serve /metrics on their ports of before.
        delivery = json.loads((tmp_path / "state" / "processes.json").read_text())["children"]["delivery"]
        os.kill(delivery, signal.SIGKILL)
        for name in ("gateway", "delivery"):
            metrics = httpx.get(f"http://127.0.0.1:{scraped[name]}/metrics", timeout=30)
            assert metrics.status_code == 200 and "arena_" in metrics.text
        roster = json.loads((tmp_path / "state" / "processes.json").read_text())["children"]
        assert roster["delivery"] != delivery
    finally:
        proc.send_signal(signal.SIGTERM)
        finished(proc, timeout=60)


def _own_gateway_answered(state, killed: int) -> bool:
    """The gateway that answered is the stack's new one (its roster names another pid)."""
    return json.loads((state / "processes.json").read_text())["children"]["gateway"] != killed


def test_arena_up_starts_its_nats_server_with_the_sync_policy_asked(tmp_path):
    up = ArenaUp(tmp_path, "--nats-sync", "10s")
    try:
        [server] = [p for p in psutil.Process(up.proc.pid).children() if p.name() == "nats-server"]
        args = server.cmdline()
        config = Path(args[args.index("-c") + 1])
        assert config == up.state / "nats-server.conf"
        varz = varz_of(config, tmp_path / "copy")  # the same file, in a server with a monitoring port
        assert varz["jetstream"]["config"]["sync_interval"] == 10_000_000_000
        assert not varz["jetstream"]["config"].get("sync_always") and varz["auth_required"]
        assert any("fsync: every 10s" in line for line in up.lines), up.lines
    finally:
        assert up.stop() == 0
