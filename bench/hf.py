"""The Hugging Face side shared by the naive server and the ceiling.

Both render chat messages and call `model.generate` the same way, so the ceiling's
compute time is the compute a served request needs.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer


@dataclass
class LoadedModel:
    """A model with its tokenizer, ready for greedy generation."""

    name: str
    model: Any
    tokenizer: Any

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def load(path: str | Path, name: str | None = None, dtype: str = "float32") -> LoadedModel:
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    return LoadedModel(name or Path(path).name, model, tokenizer)


def render(tokenizer, messages: list[dict]) -> str:
    """The prompt text: the tokenizer's chat template, or a plain fallback without one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return (tokenizer.bos_token or "") + "\n".join(lines) + "\nassistant:"


def encode(lm: LoadedModel, prompts: list[str]) -> dict:
    # The rendered text carries its own BOS (template or fallback).
    return lm.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


@dataclass
class TokenTimer(BaseStreamer):
    """Records when generate produced each step; forwards new tokens to `on_tokens`.

    `generate` calls `put` once with the prompt, then once per step with the new
    token of each sequence in the batch.
    """

    on_tokens: object = None
    started: float = field(default_factory=time.perf_counter)
    step_times: list[float] = field(default_factory=list)
    _prompt_seen: bool = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.step_times.append(time.perf_counter() - self.started)
        if callable(self.on_tokens):
            self.on_tokens(value.reshape(-1).tolist())

    def end(self) -> None:
        if callable(self.on_tokens):
            self.on_tokens(None)

    @property
    def first_token_s(self) -> float | None:
        return self.step_times[0] if self.step_times else None


class _StopWhenSet(StoppingCriteria):
    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        return self.event.is_set()


def generate(
    lm: LoadedModel,
    batch: dict,
    max_tokens: int,
    ignore_eos: bool = True,
    streamer: BaseStreamer | None = None,
    stop: threading.Event | None = None,
) -> torch.Tensor:
    """Greedy generation; returns only the new tokens, shape (batch, steps).

    `ignore_eos` keeps generating to `max_tokens`; setting `stop` ends it at the next step.
    """
    kwargs = {"max_new_tokens": max_tokens, "do_sample": False, "pad_token_id": lm.tokenizer.pad_token_id}
    if ignore_eos:
        kwargs["min_new_tokens"] = max_tokens
    if stop is not None:
        kwargs["stopping_criteria"] = StoppingCriteriaList([_StopWhenSet(stop)])
    with torch.inference_mode():
        out = lm.model.generate(**batch, streamer=streamer, **kwargs)
    return out[:, batch["input_ids"].shape[1] :]
