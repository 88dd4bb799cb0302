"""The streamed engines' read (consumers/inference/streamed.py): the events a paced read
took become one output, and a stream paces only while its server steps fast."""

from __future__ import annotations

from consumers.inference.engine.sampling import TokenLogprob
from consumers.inference.engine_io import StepOutput
from consumers.inference.streamed import READ_EVERY_S, merged, paces


def out(ids: list[int], text: str, done: int, finished: bool = False, logprobs=None) -> StepOutput:
    return StepOutput("r", ids, text, finished, "stop" if finished else None, 7, done, logprobs)


def test_one_output_is_itself():
    one = out([1], "a", 1)
    assert merged([one]) is one


def test_a_reads_outputs_are_one_in_order_with_the_last_ones_end_and_counts():
    m = merged([out([1], "a", 4), out([2, 3], "bc", 6), out([], "", 6, finished=True)])
    assert (m.new_token_ids, m.new_text) == ([1, 2, 3], "abc")
    assert (m.finished, m.finish_reason, m.completion_tokens, m.prompt_tokens) == (True, "stop", 6, 7)
    assert m.logprobs is None


def test_log_probabilities_are_joined_in_order():
    lp = [TokenLogprob(token_id=t, logprob=-0.5 * t, top=()) for t in (1, 2)]
    m = merged([out([1], "a", 1, logprobs=lp[:1]), out([2], "b", 2, logprobs=lp[1:])])
    assert [p.token_id for p in m.logprobs] == [1, 2]


def test_a_stream_paces_only_where_two_tokens_come_within_a_read():
    assert not paces(None)  # no step seen yet: its first token is read at once
    assert paces(0.0124)  # llama-server alone: 12 ms a token
    assert paces(READ_EVERY_S / 2)
    assert not paces(READ_EVERY_S / 2 + 0.001)
    assert not paces(0.06)  # 8 users: a token a read anyway
