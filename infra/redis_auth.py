"""Who may touch which Redis keys: one Redis ACL user per process role, as NATS has one
per role (`infra.nats_auth`), from the same registry (`events.topology.ROLES`).

The keys come from the key layout contract: `events.readmodel` (results, pending
records, owners), `events.arena_readmodel` (the leaderboard, the arena's secret),
`gateway.keys`, `gateway.ratelimit` and `gateway.admission` (the gateway's own). So
delivery may only write results; the gateway reads results and the leaderboard and
reads and writes only its own keys; the leaderboard may only write its projection; a
role with no keys declared (filter, inference, a new one) may authenticate and PING,
nothing more. The commands a Lua script runs are checked against its caller's ACL too:
they are read from the scripts' source. The operator (`arena rebuild-readmodel`) may do
everything; the default user is off, so an anonymous client is refused (NOAUTH).

Rendered from the one table as a redis-server ACL file (`arena up` writes one per run,
random passwords stored as SHA-256 hashes, and starts redis-server with `--aclfile`),
as `ACL SETUSER` commands for a Redis already running, and as a Kubernetes Secret with
each user's URL and both of those.

    python -m infra.redis_auth table                  # the ACL rules, as JSON
    python -m infra.redis_auth secret [--url URL]     # a Secret with fresh random passwords
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
import secrets
import sys
from dataclasses import dataclass

import yaml

from events import arena_readmodel as arm
from events import readmodel as rm
from events import topology
from gateway import keys, ratelimit
from gateway.admission import recent
from infra.nats_auth import kubernetes_secret

#: The operator's user (`arena rebuild-readmodel`): every key and command.
OPERATOR = "operator"
#: The Kubernetes Secret holding each user's URL (key: the user's name) and the ACL.
SECRET_NAME = "arena-redis-credentials"
ACL_FILE_KEY, SETUSER_KEY = "users.acl", "acl-setuser"
#: What the Secret's URLs point at unless `--url` says otherwise.
DEFAULT_URL = "redis://redis.arena.svc.cluster.local:6379/0"
#: The default user: off, so no client can be it (no password, no `nopass`: an anonymous
#: client is refused). Its permissions stay whole because redis-server replays the
#: append-only file as the default user and re-checks the commands of each MULTI/EXEC
#: (the effects of the gateway's scripts) against them: with none, a restart silently
#: drops those writes (redis/redis#14541, still so in 7.0 and 7.2; fixed by #14545).
DEFAULT_USER = ["off", "~*", "&*", "+@all"]
#: Every user: redis-py checks an idle connection with PING before it uses it.
HEALTH = ("ping",)
#: How redis-py runs a script: EVALSHA, and SCRIPT LOAD once the server does not know it.
SCRIPT_CALLS = ("evalsha", "script|load")


def pattern(layout: str) -> str:
    """A key layout ("arena:result:{}") as an ACL glob ("arena:result:*")."""
    return layout.split("{", 1)[0] + "*" if "{" in layout else layout


def script_commands(script: str) -> tuple[str, ...]:
    """The commands a Lua script calls (redis.call('X', ...)), lower-cased."""
    return tuple(dict.fromkeys(c.lower() for c in re.findall(r"redis\.call\(\s*'(\w+)'", script)))


LEADERBOARDS = (arm.LEADERBOARD, f"{arm.LEADERBOARD}:*")  # the board and its views


@dataclass(frozen=True)
class Access:
    """A role's Redis keys (ACL glob patterns) and the commands it runs on them."""

    reads: tuple[str, ...] = ()
    #: Written, never read back (a SET without GET needs no read permission).
    writes: tuple[str, ...] = ()
    #: Read and written.
    owns: tuple[str, ...] = ()
    commands: tuple[str, ...] = ()
    #: Lua scripts it runs: EVALSHA and the commands inside them.
    scripts: tuple[str, ...] = ()

    @property
    def touches_keys(self) -> bool:
        return bool(self.reads or self.writes or self.owns)

    def all_commands(self) -> tuple[str, ...]:
        inside = [c for s in self.scripts for c in script_commands(s)]
        calls = SCRIPT_CALLS if self.scripts else ()
        return tuple(dict.fromkeys([*HEALTH, *self.commands, *calls, *inside]))


#: Not declared in the topology: the Redis keys of the roles that use Redis.
ACCESS: dict[str, Access] = {
    topology.DELIVERY.name: Access(writes=(pattern(rm.RESULT),), commands=("set",)),
    topology.GATEWAY.name: Access(
        reads=(pattern(rm.RESULT), *LEADERBOARDS),
        owns=(
            pattern(rm.PENDING),
            pattern(rm.OWNER),
            pattern(keys.IDEM),
            pattern(keys.SEED),
            pattern(keys.HOLDER),
            pattern(ratelimit.BUCKETS),
            pattern(recent.RECENT_KEY),
            arm.SECRET,
            f"{arm.INTEGRITY}:*",  # the vote rules' counters and voter records
        ),
        commands=("get", "set", "del", "zrem", "incrby", "expire"),  # as redis-py sends them (incr: INCRBY)
        scripts=(ratelimit.TAKE, recent.RECENT, recent.PUBLISHED, recent.PUBLISHED_HERE),
    ),
    topology.LEADERBOARD.name: Access(writes=LEADERBOARDS, commands=("set",)),
}


@dataclass(frozen=True)
class User:
    name: str
    access: Access
    everything: bool = False

    def rules(self) -> list[str]:
        """The ACL rules after the password: keys by permission (%R~ read, %W~ write, ~
        both), no pub/sub channel, only its commands."""
        if self.everything:
            return ["~*", "&*", "+@all"]
        a = self.access
        keyed = [f"%R~{k}" for k in a.reads] + [f"%W~{k}" for k in a.writes] + [f"~{k}" for k in a.owns]
        return ["resetchannels", "-@all", *(f"+{c}" for c in a.all_commands()), *keyed]

    def may(self, key: str, write: bool = False) -> bool:
        """What redis-server decides for a read (or a write) of `key` by this user."""
        if self.everything:
            return True
        a = self.access
        return any(fnmatch.fnmatchcase(key, p) for p in (*a.owns, *(a.writes if write else a.reads)))

    def as_json(self) -> dict:
        a = self.access
        if self.everything:
            return {"keys": "all", "commands": "all"}
        return {
            "reads": list(a.reads),
            "writes": list(a.writes),
            "owns": list(a.owns),
            "commands": list(a.all_commands()),
        }


def table() -> list[User]:
    """Every role's user (in the registry's order), then the operator's."""
    return [User(r.name, ACCESS.get(r.name, Access())) for r in topology.ROLES] + [User(OPERATOR, Access(), True)]


def users() -> list[str]:
    return [u.name for u in table()]


def with_keys() -> list[str]:
    """The roles that touch a Redis key (the others need no Redis URL)."""
    return [u.name for u in table() if not u.everything and u.access.touches_keys]


def new_passwords() -> dict[str, str]:
    """A fresh random password per user (URL-safe, so it can sit in a redis:// URL)."""
    return {user: secrets.token_urlsafe(24) for user in users()}


def _hashed(password: str) -> str:
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def _lines(passwords: dict[str, str]) -> list[tuple[str, list[str]]]:
    missing = set(users()) - set(passwords)
    if missing:
        raise ValueError(f"no password for {sorted(missing)}")
    out = [(u.name, ["on", _hashed(passwords[u.name]), *u.rules()]) for u in table()]
    return [*out, ("default", DEFAULT_USER)]


def acl_file(passwords: dict[str, str]) -> str:
    """A redis-server ACL file (`--aclfile`; it takes no comments): the users, only
    hashes of their passwords, and the default user off."""
    return "".join(" ".join(["user", name, *rules]) + "\n" for name, rules in _lines(passwords))


def setuser_commands(passwords: dict[str, str]) -> str:
    """The same users as `ACL SETUSER` commands, for a Redis already running
    (`redis-cli < file`); the default user is turned off last."""
    return "".join(" ".join(["ACL", "SETUSER", name, "reset", *rules]) + "\n" for name, rules in _lines(passwords))


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` (redis:// or rediss://) with a user and password in it (instead of any it had)."""
    scheme, rest = url.split("://", 1)
    if scheme not in ("redis", "rediss"):
        raise ValueError(f"per-role Redis users need a redis:// or rediss:// URL, not {scheme}://")
    return f"{scheme}://{user}:{password}@{rest.rpartition('@')[2]}"


def urls(url: str, passwords: dict[str, str]) -> dict[str, str]:
    """Each user's URL to a server at `url`."""
    return {user: with_credentials(url, user, passwords[user]) for user in users()}


def secret_manifest(url: str = DEFAULT_URL, passwords: dict[str, str] | None = None) -> dict:
    passwords = passwords or new_passwords()
    data = {**urls(url, passwords), ACL_FILE_KEY: acl_file(passwords), SETUSER_KEY: setuser_commands(passwords)}
    return kubernetes_secret(SECRET_NAME, data)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ACL file) as YAML literal blocks, readable in the Secret."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.redis_auth", description="Redis users per arenaflow role")
    p.add_argument("cmd", nargs="?", choices=("table", "secret"), default="table")
    p.add_argument("--url", default=DEFAULT_URL, help="the Redis the Secret's URLs point at (secret)")
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(json.dumps({u.name: {**u.as_json(), "acl": " ".join(u.rules())} for u in table()}, indent=2))
    else:
        sys.stdout.write(yaml.dump(secret_manifest(args.url), Dumper=_Dumper, sort_keys=False, width=400))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
