"""events/fleet.py: the heartbeats' contract, and the wire format of the dict beats before it."""

from __future__ import annotations

import json

import pytest

from events.fleet import EngineLoad, InferenceBeat, LeaderboardBeat, ModelLoad, ProcessBeat, decode_beat, encode_beat

#: An inference beat as the dict-building worker sent it (no schema_version).
DICT_BEAT = {
    "role": "inference",
    "instance": "w1",
    "ready": True,
    "ts": 1700000000.0,
    "pid": 42,
    "metrics_port": 9100,
    "models": ["a", "v"],
    "resident": ["a"],
    "resident_bytes": 1000,
    "context": {"a": 512, "v": 512},
    "defaults": {"v": {"base": "a", "temperature": 1.2}},
    "owners": {"a": "acme", "v": "acme"},
    "jobs": 3,
    "held": 1,
    "acks": ["$JS.ACK.x"],
    "load": {
        "a": {
            "running": 2,
            "waiting": 1,
            "max_batch": 8,
            "tokens": 40,
            "measured_at": 1.0,
            "step_s": 0.01,
            "full_step_s": None,
            "full_batch": None,
        }
    },
    "engine": "continuous",
}


def test_a_beat_of_the_dict_era_decodes_as_its_roles_model_and_writes_the_same_keys():
    beat = decode_beat(json.dumps(DICT_BEAT))
    assert isinstance(beat, InferenceBeat) and beat.schema_version == 1
    assert beat.load["a"].running == 2 and beat.defaults["v"].temperature == 1.2 and beat.acks == ("$JS.ACK.x",)
    assert decode_beat(encode_beat(beat)) == beat
    # What a reader of the dict beats reads: the same keys and values, less those that were
    # None, and the fields added since at their defaults (a reader ignores keys it does not know).
    sent = json.loads(encode_beat(beat))
    assert sent.pop("schema_version") == 1
    load = {k: v for k, v in DICT_BEAT["load"]["a"].items() if v is not None}
    added = {"loading": [], "unavailable": []}
    assert sent == {
        **DICT_BEAT,
        **added,
        "load": {"a": {**load, "prefill_share": 0.0, "recent_running": 0, "ends": []}},
    }


def test_roles_without_a_beat_of_their_own_and_fields_from_a_newer_contract():
    filt = decode_beat(json.dumps({**DICT_BEAT, "role": "filter", "new_field": 1}))
    assert type(filt) is ProcessBeat and filt.role == "filter"  # the inference fields are ignored, not refused
    board = decode_beat(encode_beat(LeaderboardBeat(instance="l", ready=True, ts=1.0, pid=1, seq=7)))
    assert isinstance(board, LeaderboardBeat) and board.seq == 7


@pytest.mark.parametrize("raw", [b"not json", b"[1]", json.dumps({"role": "inference", "ts": 1.0}).encode()])
def test_what_is_no_beat_is_a_value_error(raw):
    with pytest.raises(ValueError):
        decode_beat(raw)


def test_model_load_adds_counts_and_keeps_the_slower_step():
    one = ModelLoad(running=2, waiting=1, max_batch=8, tokens=10, step_s=0.01, measured_at=5.0, ends=(3, 7))
    two = EngineLoad(running=1, max_batch=8, step_s=0.02, full_step_s=0.05, full_batch=6, measured_at=3.0, ends=(5,))
    total = one.plus(two).plus(ModelLoad(tokens=5, full_step_s=0.04, full_batch=8))
    assert (total.running, total.waiting, total.max_batch, total.tokens) == (3, 1, 16, 15)
    assert total.ends == (3, 5, 7)  # the running budgets left, fewest first, over the engines
    assert (total.step_s, total.full_step_s, total.full_batch, total.measured_at) == (0.02, 0.05, 6, 5.0)


def test_gateway_news_keeps_the_compact_wire_both_ways():
    from events.fleet import GatewayAdmissions, GatewayDemand, decode_news, encode_news

    demand = GatewayDemand(gateway="g1", demand={"m": 2.5})
    passed = GatewayAdmissions(gateway="g1", model="m", requests=(("r1", 64), ("r2", 16)), state="pass")
    one = GatewayAdmissions(gateway="g1", model="m", requests=(("r1", 64),), state="pub")
    # the arrays and object gateways exchanged before these types, read and written alike
    assert encode_news(demand) == b'{"gateway":"g1","demand":{"m":2.5}}'
    assert encode_news(passed) == b'["g1","m",[["r1",64],["r2",16]],"pass"]'
    assert encode_news(one) == b'["g1","m","r1",64,"pub"]'
    for news in (demand, passed, one):
        assert decode_news(encode_news(news)) == news


@pytest.mark.parametrize("raw", [b"[1, 2]", b'["g", "m", "r", 1, "maybe"]', b"{}", b"not json", b"3"])
def test_anything_else_on_the_news_subject_is_a_value_error(raw):
    from events.fleet import decode_news

    with pytest.raises(ValueError):
        decode_news(raw)
