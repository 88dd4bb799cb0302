"""A consumer process's health, readiness and metrics endpoint, over a real socket."""

from __future__ import annotations

import httpx

from runtime.http import ProcessEndpoint


async def test_health_readiness_and_metrics():
    state = {"ready": False}
    endpoint = ProcessEndpoint("filter", lambda: state["ready"])
    port = await endpoint.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).json() == {"status": "ok", "role": "filter"}
            assert (await client.get("/readyz")).status_code == 503
            state["ready"] = True
            assert (await client.get("/readyz")).status_code == 200
            metrics = await client.get("/metrics")
            assert metrics.status_code == 200 and "python_info" in metrics.text
            assert (await client.get("/nope")).status_code == 404
    finally:
        await endpoint.stop()
