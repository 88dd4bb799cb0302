"""The Redis users, enforced by a real redis-server started with the generated ACL file:
each role's own code paths run under its user, anything else is refused, a restart keeps
the users, and the Secret's ACL file and `ACL SETUSER` commands load as rendered."""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import sys

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError
from redis.retry import Retry

from events import arena_readmodel as arm
from events.readmodel import RESULT, ReadModel
from gateway.admission.estimate import StreamState
from gateway.admission.recent import FleetAdmissions
from gateway.arena.integrity import Integrity, IntegrityConfig
from gateway.keys import GatewayKeys
from gateway.ratelimit import Limits, RateLimiter
from infra import redis_auth
from infra.servers import LocalServer, start_redis, wait_port
from runtime.redis import redis_client
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

#: A refused login is a ConnectionError to redis-py: not retried here.
ONCE = Retry(NoBackoff(), 0)
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


@pytest.fixture
def secured(tmp_path):
    """A redis-server with the users of the table; (server, each user's URL)."""
    passwords = redis_auth.new_passwords()
    acl = tmp_path / "users.acl"
    acl.write_text(redis_auth.acl_file(passwords))
    server = start_redis(tmp_path / "data", acl=acl, log_file=tmp_path / "redis.log")
    yield server, redis_auth.urls(server.url, passwords)
    server.stop()


def refused_anonymously(server: LocalServer) -> None:
    with pytest.raises(AuthenticationError), redis.Redis("127.0.0.1", server.port, retry=ONCE) as anonymous:
        anonymous.set("x", 1)
    out = subprocess.run(
        ["redis-cli", "-p", str(server.port), "SET", "x", "1"], capture_output=True, text=True, check=False
    )
    assert "NOAUTH" in out.stdout + out.stderr


def test_an_anonymous_client_or_a_wrong_password_is_refused(secured):
    server, urls = secured
    refused_anonymously(server)
    with (
        pytest.raises(AuthenticationError),
        redis.Redis("127.0.0.1", server.port, username="gateway", password="no", retry=ONCE) as r,
    ):
        r.ping()
    for as_default in ({"password": "x"}, {"username": "default", "password": "guess"}):  # off: nobody can be it
        with pytest.raises(AuthenticationError), redis.Redis("127.0.0.1", server.port, retry=ONCE, **as_default) as r:
            r.ping()
    with redis.Redis.from_url(urls["filter"]) as plain:
        assert plain.ping()


async def gateway_paths(url: str) -> dict:
    """Every Redis call the gateway makes, as its modules make them."""
    client = redis_client(url)
    try:
        results, own = ReadModel(client, 60), GatewayKeys(client, 60)
        assert await own.claim_key("k1", "r1", "h") == {"request_id": "r1", "body_hash": "h"}
        await own.release_key("k1", "r1")
        assert await own.seed_for("c1", 0, 7) == 7
        await own.hold("r1", "sock-1")
        assert await own.holder("r1") == "sock-1"
        assert await own.bind_owner("r1", "c1", "p1") == "p1" and await own.owner("req", "r1") == "p1"
        await results.record_pending("r1", "c1", 0, "m", 1.0)
        await results.restore_owner("r2", "p1")
        assert (await results.pending("r1"))["conv_id"] == "c1"
        verdict = await RateLimiter(client).take("p1", Limits(rpm=10, tpm=1000), 5)
        assert verdict is not None and verdict.ok
        admissions = FleetAdmissions(client, StreamState)
        member, refused = await admissions.admit("m", 5, lambda *_: None)
        assert refused is None
        await admissions.settle("m", member, 5, published=True)
        await admissions.published_here("m", "other", 5)
        await admissions.remove("m", "other", 5)
        assert len(await arm.arena_secret(client)) == 32
        rules = Integrity(client, IntegrityConfig())
        counted = await rules.tally(battle_id="b1", voter="v1", score=1.0, pair_counts=(0, 0), prompts=["p"], now=NOW)
        assert counted.rule is None and (await rules.voter("v1")).battles[-1] == "b1"
        return {"result": await results.get_result("r0"), "board": await arm.load_leaderboard(client)}
    finally:
        await client.aclose()


def test_each_role_runs_its_own_code_paths_under_its_user(secured):
    _, urls = secured

    async def run() -> dict:
        delivery, leaderboard = redis_client(urls["delivery"]), redis_client(urls["leaderboard"])
        try:
            assert await ReadModel(delivery).save_result("r0", b'{"type": "chat.completed"}')
            await arm.save_leaderboard(leaderboard, {"seq": 3, "rows": []})
        finally:
            await delivery.aclose()
            await leaderboard.aclose()
        return await gateway_paths(urls["gateway"])

    seen = asyncio.run(run())
    assert seen == {"result": b'{"type": "chat.completed"}', "board": {"seq": 3, "rows": []}}


@pytest.mark.parametrize(
    ("user", "command"),
    [
        ("gateway", ("SET", RESULT.format("r9"), "forged")),
        ("gateway", ("DEL", RESULT.format("r9"))),
        ("gateway", ("SET", arm.LEADERBOARD, "{}")),
        ("gateway", ("FLUSHALL",)),
        ("gateway", ("KEYS", "*")),
        ("gateway", ("PUBLISH", "c", "m")),
        ("gateway", ("CONFIG", "SET", "appendonly", "no")),
        ("gateway", ("EVAL", "return 1", "0")),
        ("delivery", ("GET", RESULT.format("r9"))),
        ("delivery", ("SET", "arena:idem:k", "x")),
        ("leaderboard", ("GET", RESULT.format("r9"))),
        ("filter", ("SET", RESULT.format("r9"), "forged")),
        ("inference", ("GET", "arena:secret")),
    ],
)
def test_no_role_reaches_a_key_or_command_that_is_not_its_own(secured, user, command):
    _, urls = secured
    with pytest.raises(NoPermissionError), redis.Redis.from_url(urls[user]) as client:
        client.execute_command(*command)


def test_the_gateway_s_read_model_cannot_store_a_result(secured):
    _, urls = secured

    async def forge() -> None:
        client = redis_client(urls["gateway"])
        try:
            await ReadModel(client).save_result("r9", b"forged")
        finally:
            await client.aclose()

    with pytest.raises(NoPermissionError):
        asyncio.run(forge())
    with redis.Redis.from_url(urls[redis_auth.OPERATOR]) as operator:
        assert operator.keys("*") == [] and operator.acl_whoami() == "operator"


def test_a_restart_of_the_server_reads_the_same_users_and_replays_the_scripts_writes(secured):
    """The append-only file is replayed as the default user: the scripts' writes (a
    MULTI/EXEC each) come back only because that user, though off, keeps its permissions."""
    server, urls = secured
    asyncio.run(gateway_paths(urls["gateway"]))
    server.stop()  # SIGTERM: the append-only file is flushed
    server.respawn()
    wait_port(server.port, server.proc)
    refused_anonymously(server)
    with redis.Redis.from_url(urls[redis_auth.OPERATOR]) as operator:
        assert operator.exists("arena:rl:p1:req", "arena:admitted:m", "arena:idem:k1") == 2
        assert "off" in operator.acl_getuser("default")["flags"]
    assert "NOPERM" not in server.log_file.read_text()
    seen = asyncio.run(gateway_paths(urls["gateway"]))
    assert seen["result"] is None
    server.proc.kill()  # and a kill -9
    server.proc.wait()
    server.respawn()
    wait_port(server.port, server.proc)
    refused_anonymously(server)


def test_the_secret_s_acl_file_and_setuser_commands_load_into_redis(tmp_path):
    plain = start_redis(tmp_path / "plain")  # a Redis already running, no users yet
    doc = yaml.safe_load(
        subprocess.run(
            [sys.executable, "-m", "infra.redis_auth", "secret", "--url", plain.url],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        ).stdout
    )
    data = doc["stringData"]
    try:
        with redis.Redis("127.0.0.1", plain.port) as admin:
            for line in data[redis_auth.SETUSER_KEY].splitlines():
                admin.execute_command(*line.split())
        refused_anonymously(plain)
        assert asyncio.run(gateway_paths(data["gateway"]))["result"] is None
    finally:
        plain.stop()
    acl = tmp_path / "users.acl"
    acl.write_text(data[redis_auth.ACL_FILE_KEY])
    mounted = start_redis(tmp_path / "mounted", port=plain.port, acl=acl)  # the same URLs
    try:
        refused_anonymously(mounted)
        with redis.Redis.from_url(data["delivery"]) as delivery:
            assert delivery.set(RESULT.format("r1"), "x", nx=True)
    finally:
        mounted.stop()
