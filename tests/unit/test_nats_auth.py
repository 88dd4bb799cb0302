"""The permission table (infra/nats_auth.py): who may publish what, decided per subject
the way nats-server decides it, and the files rendered from it."""

from __future__ import annotations

import pytest
import yaml

from events import subjects as s
from events import topology
from infra import nats_auth
from tests.conftest import REPO

RID, CONV = "r1", "c1"


def perms(user: str) -> nats_auth.Permissions:
    return next(p for p in nats_auth.table() if p.user == user)


def publishers(subject: str) -> set[str]:
    return {p.user for p in nats_auth.table() if p.user != nats_auth.OPERATOR and p.may_publish(subject)}


@pytest.mark.parametrize(
    ("stem", "only"),
    [
        (s.REQUESTED, {"gateway"}),
        (s.CANCELLED, {"gateway"}),
        (s.ACCEPTED, {"filter"}),
        (s.REJECTED, {"filter"}),
        (s.TOKENS, {"inference"}),
        (s.COMPLETED, {"inference"}),
        (s.FAILED, {"inference"}),
    ],
)
def test_each_request_event_has_exactly_the_publisher_the_topology_names(stem, only):
    assert publishers(f"{stem}.{CONV}.{RID}") == only


def test_battle_events_come_from_the_gateway_only():
    assert publishers(f"{s.BATTLE_PREFIX}.voted.b1") == {"gateway"}


def test_live_fan_out_is_inference_s_and_delivery_s_and_heartbeats_are_each_role_s_own():
    assert publishers(s.live_subject(RID)) == {"delivery", "inference"}
    assert publishers(s.heartbeat_subject("inference", "host-1")) == {"inference"}
    assert publishers(s.heartbeat_subject("filter", "host-1")) == {"filter"}


def test_no_role_may_manage_the_stream_or_pull_another_role_s_work():
    for p in nats_auth.table():
        if p.user == nats_auth.OPERATOR:
            continue
        for api in (
            "$JS.API.STREAM.UPDATE.ARENA",
            "$JS.API.STREAM.DELETE.ARENA",
            "$JS.API.STREAM.PURGE.ARENA",
            "$JS.API.CONSUMER.CREATE.ARENA.inference.arena.req.accepted.>",
            "$JS.API.CONSUMER.DELETE.ARENA.delivery",
        ):
            assert not p.may_publish(api), (p.user, api)
        assert p.may_publish("$JS.API.STREAM.INFO.ARENA")
        assert p.may_publish("$JS.API.CONSUMER.CREATE.ARENA")  # ephemeral readers (replay, history)
        for durable in ("filter", "delivery", "inference", "leaderboard"):
            pull = f"$JS.API.CONSUMER.MSG.NEXT.ARENA.{durable}"
            assert p.may_publish(pull) == (p.user == durable), (p.user, pull)


def test_every_role_reads_its_replies_and_the_operator_may_do_anything():
    assert all("_INBOX.>" in p.subscribe for p in nats_auth.table() if p.user != nats_auth.OPERATOR)
    assert perms(nats_auth.OPERATOR).may_publish(f"{s.COMPLETED}.{CONV}.{RID}")
    assert perms("inference").responds and not perms("gateway").responds


def test_a_role_added_to_the_topology_gets_a_user(monkeypatch):
    toy = topology.Role(name="toy", entry="x:main", reads="arena.res.completed.>")
    monkeypatch.setattr(topology, "ROLES", [*topology.ROLES, toy])
    p = perms("toy")
    assert p.may_publish("$JS.API.CONSUMER.MSG.NEXT.ARENA.toy") and p.may_publish("arena.hb.toy.i1")
    assert not p.may_publish(f"{s.COMPLETED}.{CONV}.{RID}")
    assert not perms("inference").may_publish("$JS.API.CONSUMER.MSG.NEXT.ARENA.toy")


def test_server_config_names_every_user_with_a_password_and_refuses_a_missing_one():
    passwords = nats_auth.new_passwords()
    text = nats_auth.server_config(passwords)
    for user, password in passwords.items():
        assert f'"user": "{user}"' in text and password in text
    with pytest.raises(ValueError, match="no password"):
        nats_auth.server_config({"gateway": "x"})
    assert len(set(passwords.values())) == len(passwords)


def test_the_committed_helm_values_are_the_generated_ones():
    path = REPO / "infra" / "k8s" / "nats" / "values.yaml"
    committed = yaml.safe_load(path.read_text())
    assert committed == nats_auth.helm_values(), "regenerate: python -m infra.nats_auth helm-values > " + str(path)
    assert path.read_text().startswith(nats_auth.HELM_HEADER)
    users = committed["config"]["merge"]["authorization"]["users"]
    assert {u["user"] for u in users} == set(nats_auth.users())
    # Passwords are references to the Secret, never values.
    assert all(u["password"] == f"<< ${nats_auth.password_env(u['user'])} >>" for u in users)
    env = committed["container"]["env"]
    assert all(v["valueFrom"]["secretKeyRef"]["name"] == nats_auth.SECRET_NAME for v in env.values())
    assert committed["config"]["cluster"]["replicas"] == 3
    assert committed["config"]["jetstream"]["fileStore"]["pvc"]["enabled"] is True


def test_the_secret_carries_one_fresh_password_per_user():
    a, b = nats_auth.secret_manifest(), nats_auth.secret_manifest()
    assert set(a["stringData"]) == set(nats_auth.users())
    assert a["stringData"] != b["stringData"]
