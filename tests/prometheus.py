"""Debian's Prometheus on the configuration `arena up` wrote, for the tests that watch a
real stack, and the waits and queries they read it with."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from runtime.net import free_port
from tests import waiting


@contextmanager
def run_prometheus(config: Path, data: Path) -> Iterator[str]:
    """A Prometheus scraping what `config` says, its store in `data`; its URL once ready."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: apt-get install prometheus (.ci/run does)")
    port = free_port()
    with open(data / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200, 30, "prometheus ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def wait_for(check, timeout: float, what: str):
    """Poll `check()` every 0.5 s; a failed HTTP call counts as not yet."""
    return waiting.wait_for(check, timeout, what, ignoring=(httpx.HTTPError,))


def query(url: str, promql: str) -> list[dict]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5)
    r.raise_for_status()
    return r.json()["data"]["result"]


def active_targets(url: str) -> list[dict]:
    return httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
