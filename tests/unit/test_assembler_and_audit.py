from events.models import ChatCompleted, ChatMessage, ChatRequested, SamplingParams, Timings, TokensGenerated, Usage
from gateway.assembler import Assembler
from infra.audit import audit, parse_window


def chunk(seq, text):
    return TokensGenerated(request_id="r", conv_id="c", seq=seq, text=text, token_ids=(1,), model="m")


def done(text, chunks, rid="r"):
    return ChatCompleted(
        request_id=rid,
        conv_id="c",
        model="m",
        text=text,
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        timings=Timings(queue_wait_s=0, ttft_s=0, decode_s=0, compute_s=0),
        chunks=chunks,
    )


def test_chunks_come_out_once_and_in_order():
    a = Assembler()
    assert a.add(chunk(1, "b")) == []
    assert [c.seq for c in a.add(chunk(0, "a"))] == [0, 1]
    assert a.add(chunk(1, "b")) == []  # duplicate
    a.add(done("abc", 3))
    assert not a.done
    a.add(chunk(2, "c"))
    assert a.done and a.text == "abc"


def test_remainder_fills_chunks_that_never_came():
    a = Assembler()
    a.add(chunk(0, "ab"))
    a.add(done("abcd", 2))
    assert not a.done and a.remainder() == "cd"


def requested(rid, deadline):
    return ChatRequested(
        request_id=rid,
        conv_id="c",
        model="m",
        messages=[ChatMessage(role="user", content="x")],
        params=SamplingParams(),
        deadline_at=deadline,
    )


def test_audit_finds_missing_duplicate_and_in_flight():
    events = [
        requested("a", 0),
        done("x", 0, "a"),
        requested("b", 0),
        requested("c", 0),
        done("x", 0, "c"),
        done("x", 0, "c"),
        requested("d", 1e12),
    ]
    report = audit(events, now=100.0)
    assert report["missing_terminal"] == ["b"]
    assert report["duplicate_terminal"] == ["c"]
    assert report["in_flight"] == ["d"]
    assert not report["ok"]


def test_parse_window():
    assert parse_window("1h").total_seconds() == 3600
    assert parse_window("30m").total_seconds() == 1800
