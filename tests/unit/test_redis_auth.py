"""The Redis users (infra/redis_auth.py): one per role of the registry, each key of the
layout contract granted to the roles that use it and no other, and the files rendered
from the table (tests/integration/test_redis_auth.py loads them into a real redis-server)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import yaml
from redis.connection import parse_url

from events import arena_readmodel as arm
from events import readmodel as rm
from events import topology
from gateway import keys, ratelimit
from gateway.admission import recent
from infra import redis_auth
from runtime.redis import masked
from tests.conftest import REPO


def user(name: str) -> redis_auth.User:
    return next(u for u in redis_auth.table() if u.name == name)


def writers(key: str) -> set[str]:
    return {u.name for u in redis_auth.table() if not u.everything and u.may(key, write=True)}


def readers(key: str) -> set[str]:
    return {u.name for u in redis_auth.table() if not u.everything and u.may(key)}


def test_there_is_one_user_per_role_of_the_registry_and_the_operator():
    assert redis_auth.users() == [*topology.role_names(), redis_auth.OPERATOR]


def test_a_new_role_gets_a_user_that_may_only_authenticate_and_ping(monkeypatch):
    scorer = replace(topology.FILTER, name="scorer", entry="consumers.scorer.app:main")
    monkeypatch.setattr(topology, "ROLES", [*topology.ROLES, scorer])
    assert "scorer" in redis_auth.users() and "scorer" not in redis_auth.with_keys()
    assert user("scorer").rules() == ["resetchannels", "-@all", "+ping"]
    passwords = redis_auth.new_passwords()
    assert re.search(r"^user scorer on #[0-9a-f]{64} resetchannels -@all \+ping$", redis_auth.acl_file(passwords), re.M)
    assert "scorer" in redis_auth.secret_manifest("redis://r:6379/0", passwords)["stringData"]


@pytest.mark.parametrize(
    ("key", "written_by", "read_by"),
    [
        (rm.RESULT.format("r1"), {"delivery"}, {"gateway"}),
        (rm.PENDING.format("r1"), {"gateway"}, {"gateway"}),
        (rm.OWNER.format("req", "r1"), {"gateway"}, {"gateway"}),
        (keys.IDEM.format("k"), {"gateway"}, {"gateway"}),
        (keys.SEED.format("c", 1), {"gateway"}, {"gateway"}),
        (keys.HOLDER.format("r1"), {"gateway"}, {"gateway"}),
        (ratelimit.BUCKETS.format("key:ab12", "req"), {"gateway"}, {"gateway"}),
        (recent.RECENT_KEY.format("stories-260k"), {"gateway"}, {"gateway"}),
        (arm.SECRET, {"gateway"}, {"gateway"}),
        (arm.integrity_daily("v1", "2026-01-01"), {"gateway"}, {"gateway"}),
        (arm.LEADERBOARD, {"leaderboard"}, {"gateway"}),
        (f"{arm.LEADERBOARD}:style", {"leaderboard"}, {"gateway"}),
        ("arena:other", set(), set()),
        ("x", set(), set()),
    ],
)
def test_each_key_has_exactly_the_writers_and_readers_the_layout_names(key, written_by, read_by):
    assert writers(key) == written_by
    assert readers(key) == read_by
    assert user(redis_auth.OPERATOR).may(key, write=True)


def test_every_key_layout_in_the_code_is_granted_to_some_role():
    """A key prefix added to the code without a grant would be refused under `arena up`."""
    layouts = set()
    for root in ("events", "gateway", "consumers", "runtime"):
        for path in (REPO / root).rglob("*.py"):
            layouts |= set(re.findall(r"""["'](arena:[a-z_]+[^"'\s]*)["']""", path.read_text()))
    assert {"arena:result:{}", "arena:idem:{}", "arena:rl:{}:{}"} <= layouts
    for layout in layouts:
        key = layout.replace("{}", "x")
        assert any(writers(k) | readers(k) for k in (key, f"{key}:x")), layout  # a key, or a prefix of keys


def test_roles_without_keys_need_no_redis_and_scripts_bring_the_commands_they_call():
    assert set(redis_auth.with_keys()) == {"delivery", "gateway", "leaderboard"}
    assert redis_auth.script_commands(ratelimit.TAKE) == ("time", "hmget", "hset", "expire")
    gateway = user("gateway").access.all_commands()
    assert {"evalsha", "script|load", "zadd", "zremrangebyscore", "hset", "time"} <= set(gateway)
    assert user("delivery").access.all_commands() == ("ping", "set")
    for u in redis_auth.table():
        if not u.everything:
            assert "resetchannels" in u.rules() and not any(c in u.rules() for c in ("+@all", "+flushall", "+keys"))


def test_the_acl_file_holds_only_hashes_and_turns_the_default_user_off():
    passwords = redis_auth.new_passwords()
    text = redis_auth.acl_file(passwords)
    assert not any(p in text for p in passwords.values())
    lines = [line for line in text.splitlines() if line.startswith("user ")]
    assert [line.split()[1] for line in lines] == [*redis_auth.users(), "default"]
    assert lines[-1] == "user default off ~* &* +@all"  # off: nobody is it (see DEFAULT_USER)
    setuser = redis_auth.setuser_commands(passwords).splitlines()
    assert [line.split()[2] for line in setuser] == [*redis_auth.users(), "default"]
    assert all(line.split()[3] == "reset" for line in setuser)
    with pytest.raises(ValueError, match="no password for"):
        redis_auth.acl_file({"gateway": "x"})


def test_the_secret_holds_each_user_s_url_and_the_acl_to_load(capsys):
    passwords = redis_auth.new_passwords()
    doc = yaml.safe_load(yaml.safe_dump(redis_auth.secret_manifest("rediss://r:6380/0?ssl_ca_certs=/ca", passwords)))
    assert doc["kind"] == "Secret" and doc["metadata"]["name"] == redis_auth.SECRET_NAME
    data = doc["stringData"]
    for name in redis_auth.users():
        options = parse_url(data[name])
        assert (options["username"], options["password"], options["host"]) == (name, passwords[name], "r")
    assert data[redis_auth.ACL_FILE_KEY] == redis_auth.acl_file(passwords)
    assert data[redis_auth.SETUSER_KEY] == redis_auth.setuser_commands(passwords)
    assert redis_auth.main(["secret", "--url", "redis://redis-master:6379/0"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)["stringData"]
    assert parse_url(printed["gateway"])["host"] == "redis-master"
    assert printed[redis_auth.ACL_FILE_KEY].endswith("user default off ~* &* +@all\n")


def test_credentials_replace_any_in_the_url_and_sentinel_urls_are_refused():
    assert redis_auth.with_credentials("redis://:old@h:1/0", "gateway", "pw") == "redis://gateway:pw@h:1/0"
    with pytest.raises(ValueError, match="redis:// or rediss://"):
        redis_auth.with_credentials("redis+sentinel://h:26379/mymaster", "gateway", "pw")


def test_passwords_are_masked_in_urls_shown():
    assert masked("redis://gateway:s3cret@127.0.0.1:6390/0") == "redis://gateway:***@127.0.0.1:6390/0"
    assert masked("redis+sentinel://:s3cret@h1:1,h2:2/svc") == "redis+sentinel://:***@h1:1,h2:2/svc"
    assert masked("rediss://h:6380/0?ssl_ca_certs=/a@b") == "rediss://h:6380/0?ssl_ca_certs=/a@b"
