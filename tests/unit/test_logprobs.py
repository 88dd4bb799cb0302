"""Spelling token ids for the event's log probabilities: text and UTF-8 bytes per token,
for a SentencePiece byte-fallback tokenizer (stories260K) and a byte-level BPE (GPT-2 /
SmolLM2 style, trained here on a few lines)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from consumers.inference.engine.logprobs import spelled, speller
from consumers.inference.engine.sampling import TokenLogprob

STORIES = Path(__file__).resolve().parents[2].parent / "shared/models/stories260K-hf"
TEXT = "Once upon a time, a café served crème brûlée — 日本 too."


@pytest.fixture(scope="module")
def stories():
    return AutoTokenizer.from_pretrained(STORIES)


@pytest.fixture(scope="module")
def byte_level():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Once upon a time there was a café.", "A time to serve and a time to rest."], trainer)
    tok.add_special_tokens(["<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


# SentencePiece puts the word boundary's "▁" before the first word itself.
@pytest.mark.parametrize("which,text", [("stories", TEXT), ("byte_level", " " + TEXT)])
def test_the_tokens_bytes_make_the_text_and_split_characters_show_as_replacement(which, text, request):
    tokenizer = request.getfixturevalue(which)
    spell = speller(tokenizer)
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [spell(t) for t in token_ids]
    assert b"".join(bytes(raw) for _, raw in pieces).decode() == " " + TEXT
    for shown, raw in pieces:
        assert shown == bytes(raw).decode("utf-8", errors="replace")
    assert any("\ufffd" in shown for shown, _ in pieces)  # 日 and 本 are split between byte tokens
    assert speller(tokenizer) is spell  # one per tokenizer


def test_a_special_token_is_spelled_as_its_content(byte_level):
    eos = byte_level.convert_tokens_to_ids("<|im_end|>")
    assert speller(byte_level)(eos) == ("<|im_end|>", tuple(b"<|im_end|>"))


def test_spelled_builds_the_event_with_alternatives(stories):
    once = stories.convert_tokens_to_ids("▁Once")
    lily = stories.convert_tokens_to_ids("▁Lily")
    [entry] = spelled([TokenLogprob(once, -0.5, ((once, -0.5), (lily, -1.25)))], speller(stories))
    assert (entry.token, entry.logprob, entry.bytes) == (" Once", -0.5, tuple(b" Once"))
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(" Once", -0.5), (" Lily", -1.25)]
