"""Redis loses its data: completed answers are still served (rebuilt from the stream for
one request on demand) and `arena rebuild-readmodel` refills the whole read model."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

import httpx
import nats
import pytest
import redis

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_results_survive_a_redis_wipe(stack):
    client = redis.Redis.from_url(stack.redis.url)
    ids = []
    for i, prompt in enumerate(("Once upon a time", "The little cat", "Tom had a red ball")):
        r = httpx.post(f"{stack.url}/chat", json={"prompt": prompt, "max_tokens": 48, "temperature": 0}, timeout=30)
        assert r.status_code == 202
        ids.append(r.json()["request_id"])
        if i == 1:
            client.flushall()  # under load: two requests are running, one not yet sent
    answers = {}
    end = time.monotonic() + 60
    while len(answers) < len(ids) and time.monotonic() < end:
        for rid in ids:
            r = httpx.get(f"{stack.url}/chat/result/{rid}", timeout=10)
            if r.status_code == 200:
                answers[rid] = r.json()["text"]
        time.sleep(0.2)
    assert len(answers) == 3  # the ones running during the wipe too

    client.flushall()
    for _ in range(2):  # from the stream, on demand, each time: the gateway writes no result
        r = httpx.get(f"{stack.url}/chat/result/{ids[0]}", timeout=10)
        assert r.status_code == 200 and r.json()["text"] == answers[ids[0]]
    # Only delivery's Redis user may write results (infra/redis_auth.py); the gateway's
    # pending record and owner alone would read as a request still running.
    written = [f"arena:{kind}:{ids[0]}" for kind in ("result", "pending", "owner:req")]
    assert not client.exists(*written)

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "infra.cli",
            "rebuild-readmodel",
            "--since",
            "1h",
            "--nats-url",
            stack.nats.url,
            "--redis-url",
            stack.redis.url,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "3 requests, 3 results" in out.stdout, out.stdout
    for rid in ids:
        assert client.exists(f"arena:result:{rid}") and client.exists(f"arena:pending:{rid}")
        assert httpx.get(f"{stack.url}/chat/result/{rid}", timeout=10).json()["text"] == answers[rid]
    assert httpx.get(f"{stack.url}/chat/result/nope0000", timeout=10).status_code == 404
    client.close()


def test_probing_unknown_ids_costs_one_stream_read_each(stack):
    """An id Redis does not know is looked for in the stream once; asking again within
    the next seconds is answered from memory (a prober cannot make every GET a read)."""

    async def creates_while(probes: list[str]) -> int:
        nc = await nats.connect(stack.nats.url)
        seen = 0

        async def count(_msg) -> None:
            nonlocal seen
            seen += 1

        for subject in ("$JS.API.CONSUMER.CREATE.ARENA", "$JS.API.CONSUMER.CREATE.ARENA.>"):
            await nc.subscribe(subject, cb=count)  # every reader of the stream is a new consumer
        await nc.flush()
        async with httpx.AsyncClient(timeout=10) as client:
            for rid in probes:
                assert (await client.get(f"{stack.url}/chat/result/{rid}")).status_code == 404
        await nc.flush()
        await asyncio.sleep(0.2)
        await nc.close()
        return seen

    unknown = [uuid.uuid4().hex for _ in range(3)]
    assert asyncio.run(creates_while(unknown * 4)) == 3
