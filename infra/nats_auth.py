"""Who may publish what: one NATS user per process role, derived from the topology.

Each role's stream events come from `events.topology` (`Role.publishes`), its durable
from `Role.durable`; the core-NATS subjects that are no events (live fan-out,
heartbeats, cancellations read live, hot swap) from `events.subjects`. So the gateway
may publish requests, cancellations and battle events but no token or terminal event;
only inference publishes tokens and terminal events; the filter only its verdicts;
delivery only the live fan-out.

JetStream management (creating or changing the stream and the durables, deleting or
purging anything) is the operator's alone: a role that could update the stream could
add a subject transform and turn its own publishes into terminal events. `arena up`
(and, on Kubernetes, the `arena topology` Job) creates the topology as the operator;
the roles start with `ARENA_MANAGE_TOPOLOGY=false` and wait for it.

Rendered three ways from the one table: a nats-server `authorization` block (`arena up`
writes one per run, with random passwords), the NATS Helm chart's values (passwords
from a Secret), and that Secret.

    python -m infra.nats_auth table          # the permission table, as JSON
    python -m infra.nats_auth helm-values    # infra/k8s/nats/values.yaml
    python -m infra.nats_auth secret         # a Secret with fresh random passwords
"""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import dataclass

import yaml

from events import subjects as s
from events import topology
from infra.servers import NATS_SYNC_DEFAULT, nats_sync

#: The operator's user (`arena replay`, `audit`, `models`, `battles import`, `topology`): every subject.
OPERATOR = "operator"
INBOX = "_INBOX.>"
#: The Kubernetes Secret holding one password per user (key: the user's name).
SECRET_NAME = "arena-nats-credentials"


@dataclass(frozen=True)
class Core:
    """A role's core-NATS subjects beyond its stream events and its own heartbeats."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    #: May answer requests it receives (hot swap), on their reply subjects only.
    responds: bool = False


#: Not declared in the topology: what a role does on core NATS.
CORE: dict[str, Core] = {
    topology.GATEWAY.name: Core(
        publish=(s.GATEWAY_ADMITTED,), subscribe=(f"{s.HEARTBEAT_PREFIX}.>", f"{s.LIVE_PREFIX}.>", s.GATEWAY_ADMITTED)
    ),
    topology.DELIVERY.name: Core(publish=(f"{s.LIVE_PREFIX}.>",)),
    topology.INFERENCE.name: Core(
        publish=(f"{s.LIVE_PREFIX}.>",), subscribe=(s.CANCEL_SUBJECT, s.ADMIN_MODELS), responds=True
    ),
}


@dataclass(frozen=True)
class Permissions:
    user: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    responds: bool = False

    def may_publish(self, subject: str) -> bool:
        """What the server decides for a publish by this user (allow, then deny wins)."""
        return any(matches(p, subject) for p in self.publish) and not any(
            matches(p, subject) for p in self.deny_publish
        )

    def server_block(self) -> dict:
        """The user's `permissions` in nats-server's configuration."""
        perms: dict = {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)}}
        if self.deny_publish:
            perms["publish"]["deny"] = list(self.deny_publish)
        if self.responds:
            perms["allow_responses"] = True
        return perms


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    pt, st = pattern.split("."), subject.split(".")
    for i, token in enumerate(pt):
        if token == ">":
            return len(st) > i
        if i >= len(st) or (token != "*" and token != st[i]):
            return False
    return len(pt) == len(st)


def _durables() -> list[str]:
    return [r.durable for r in topology.consumers() if r.durable]


def js_management_denied(own_durable: str | None) -> tuple[str, ...]:
    """JetStream API calls a role may not make: managing the stream and the durables,
    deleting or purging anything, cluster operations, and pulling another role's work."""
    api = "$JS.API"
    denied = [
        f"{api}.STREAM.CREATE.>",
        f"{api}.STREAM.UPDATE.>",
        f"{api}.STREAM.DELETE.>",
        f"{api}.STREAM.PURGE.>",
        f"{api}.STREAM.MSG.DELETE.>",
        f"{api}.STREAM.RESTORE.>",
        f"{api}.STREAM.PEER.>",
        f"{api}.STREAM.LEADER.>",
        f"{api}.CONSUMER.DURABLE.CREATE.>",
        f"{api}.CONSUMER.LEADER.>",
        f"{api}.CONSUMER.PAUSE.>",
        f"{api}.CONSUMER.UNPIN.>",
        f"{api}.META.>",
        f"{api}.SERVER.>",
        f"{api}.ACCOUNT.PURGE.>",
    ]
    for durable in _durables():
        # Creating a consumer under a durable's name would change its filter or bounds.
        denied += [f"{api}.CONSUMER.CREATE.{s.STREAM}.{durable}", f"{api}.CONSUMER.CREATE.{s.STREAM}.{durable}.>"]
        denied.append(f"{api}.CONSUMER.DELETE.{s.STREAM}.{durable}")
        if durable != own_durable:
            denied.append(f"{api}.CONSUMER.MSG.NEXT.{s.STREAM}.{durable}")
    return tuple(denied)


def role_permissions(role: topology.Role) -> Permissions:
    core = CORE.get(role.name, Core())
    publish = [f"{stem}.>" for _, stem in role.publishes]
    publish += list(core.publish)
    if role.durable:
        publish.append(f"{s.HEARTBEAT_PREFIX}.{role.name}.>")  # its own heartbeats only
        publish.append(f"$JS.ACK.{s.STREAM}.{role.durable}.>")  # acks of its own durable's messages
    # The JetStream API (reads, ephemeral readers, pulls) and flow control of ordered readers.
    publish += ["$JS.API.>", f"$JS.FC.{s.STREAM}.>"]
    subscribe = [INBOX, *core.subscribe]
    return Permissions(
        user=role.name,
        publish=tuple(dict.fromkeys(publish)),
        subscribe=tuple(dict.fromkeys(subscribe)),
        deny_publish=js_management_denied(role.durable),
        responds=core.responds,
    )


def table() -> list[Permissions]:
    """Every role's permissions, then the operator's (everything)."""
    return [role_permissions(r) for r in topology.ROLES] + [Permissions(OPERATOR, (">",), (">",))]


def users() -> list[str]:
    return [p.user for p in table()]


def new_passwords() -> dict[str, str]:
    """A fresh random password per user (URL-safe, so it can sit in a nats:// URL)."""
    return {user: secrets.token_urlsafe(24) for user in users()}


def _users_block(password_of) -> list[dict]:
    return [
        {"user": p.user, "password": password_of(p.user), "permissions": p.server_block()}
        if p.user != OPERATOR
        else {"user": p.user, "password": password_of(p.user)}
        for p in table()
    ]


def server_config(passwords: dict[str, str], tls: dict | None = None) -> str:
    """A nats-server configuration file: the users with their permissions (no
    unauthenticated access), and a `tls {}` block when `tls` names cert_file, key_file
    and optionally ca_file (then client certificates are verified)."""
    missing = set(users()) - set(passwords)
    if missing:
        raise ValueError(f"no password for {sorted(missing)}")
    lines = [
        "# Generated by infra/nats_auth.py: one user per arenaflow role.",
        "authorization " + json.dumps({"users": _users_block(passwords.__getitem__)}, indent=2),
    ]
    if tls:
        block = {k: tls[k] for k in ("cert_file", "key_file", "ca_file") if tls.get(k)}
        if tls.get("ca_file") and tls.get("verify", True):
            block["verify"] = True
        lines.append("tls " + json.dumps(block, indent=2))
    return "\n".join(lines) + "\n"


def password_env(user: str) -> str:
    """The NATS server container's environment variable holding a user's password (Kubernetes)."""
    return f"ARENA_{user.upper()}_PASSWORD"


def helm_values(cluster_replicas: int = 3, storage: str = "10Gi", sync: str = NATS_SYNC_DEFAULT) -> dict:
    """Values for the official NATS Helm chart (1.x): a JetStream cluster with file
    storage on PVCs and the users above, their passwords read from the Secret; JetStream
    fsyncs as `arena up` does (`sync`: infra.servers.NATS_SYNC_DEFAULT)."""
    users_block = [{**u, "password": f"<< ${password_env(u['user'])} >>"} for u in _users_block(lambda user: "")]
    return {
        "config": {
            "cluster": {"enabled": True, "replicas": cluster_replicas},
            "jetstream": {
                "enabled": True,
                "fileStore": {"enabled": True, "dir": "/data", "pvc": {"enabled": True, "size": storage}},
                "merge": {"sync_interval": nats_sync(sync)},
            },
            "monitor": {"enabled": True, "port": 8222},  # KEDA's nats-jetstream scaler reads consumer lag here
            "merge": {"authorization": {"users": users_block}},
        },
        "container": {
            "env": {
                password_env(user): {"valueFrom": {"secretKeyRef": {"name": SECRET_NAME, "key": user}}}
                for user in users()
            }
        },
        "podTemplate": {
            "topologySpreadConstraints": {
                "kubernetes.io/hostname": {"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"},
            }
        },
    }


def kubernetes_secret(name: str, string_data: dict[str, str]) -> dict:
    """An Opaque Secret of arenaflow's (also infra.redis_auth's)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "arenaflow"}},
        "type": "Opaque",
        "stringData": string_data,
    }


def secret_manifest(passwords: dict[str, str] | None = None) -> dict:
    return kubernetes_secret(SECRET_NAME, passwords or new_passwords())


HELM_HEADER = """\
# Values for the official NATS Helm chart (nats/nats 1.x): a three-node JetStream cluster,
# file storage on PVCs, one user per arenaflow role with the permissions of
# infra/nats_auth.py, passwords from the Secret `arena-nats-credentials`, JetStream's fsync
# policy as `arena up`'s default (sync_interval; docs/operations.md, "Durability").
# Generated: python -m infra.nats_auth helm-values > infra/k8s/nats/values.yaml
# (tests/unit/test_nats_auth.py fails when this file and the table disagree.)
#
#   helm repo add nats https://nats-io.github.io/k8s/helm/charts/
#   helm upgrade --install nats nats/nats --version 1.2.6 -n arena -f infra/k8s/nats/values.yaml
"""


def main(argv: list[str] | None = None) -> int:
    cmd = (argv if argv is not None else sys.argv[1:] or ["table"])[0]
    if cmd == "table":
        print(json.dumps({p.user: p.server_block() for p in table()}, indent=2))
    elif cmd == "helm-values":
        sys.stdout.write(HELM_HEADER + yaml.safe_dump(helm_values(), sort_keys=False, width=200))
    elif cmd == "secret":
        sys.stdout.write(yaml.safe_dump(secret_manifest(), sort_keys=False))
    else:
        print("usage: python -m infra.nats_auth [table|helm-values|secret]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
