"""OpenAI's response bodies, whole and as stream chunks: chat completions
(`chat.completion`, `chat.completion.chunk`) and legacy completions (`text_completion`).

A route serves either through one path (routes_openai.py): a shape says what each piece
of the answer looks like on the wire, and nothing else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from events.models import TokenLogprob


def sse(body: dict) -> str:
    """One server-sent event carrying `body` as JSON."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    """`choices[].logprobs` of a chat answer: `content[]` of token, logprob, bytes, top_logprobs."""
    return {"content": [e.model_dump(mode="json") for e in entries], "refusal": None}


@dataclass
class ChatShape:
    """`/v1/chat/completions`' bodies."""

    request_id: str
    model: str
    logprobs: bool = False  # the client asked: every text chunk carries its tokens'

    def _base(self, obj: str) -> dict:
        return {"id": f"chatcmpl-{self.request_id}", "object": obj, "created": int(time.time()), "model": self.model}

    def _chunk(self, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return self._base("chat.completion.chunk") | {"choices": [choice]}

    def opening(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> dict:
        return self._chunk({"content": text}, logprobs=chat_logprobs(logprobs or ()) if self.logprobs else None)

    def finish(self, finish_reason: str) -> dict:
        return self._chunk({}, finish_reason)

    def usage(self, usage: dict) -> dict:
        return self._base("chat.completion.chunk") | {"choices": [], "usage": usage}

    def answer(self, text: str, finish_reason: str, usage: dict, logprobs: Sequence[TokenLogprob] | None) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": chat_logprobs(logprobs or ()) if self.logprobs else None,
        }
        return self._base("chat.completion") | {"choices": [choice], "usage": usage}


@dataclass
class CompletionShape:
    """`/v1/completions`' bodies; log probabilities in the legacy shape (tokens,
    token_logprobs, top_logprobs as {token: logprob} with the chosen token in it, and
    text_offset: each token's character offset in the text, counted across chunks)."""

    request_id: str
    model: str
    logprobs: bool = False
    _offset: int = field(default=0, init=False)

    def _body(self, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {
            "id": f"cmpl-{self.request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
        }

    def _legacy(self, entries: Sequence[TokenLogprob] | None) -> dict | None:
        if not self.logprobs:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries or ():
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({t.token: t.logprob for t in e.top_logprobs} | {e.token: e.logprob})
            out["text_offset"].append(self._offset)
            self._offset += len(e.token)
        return out

    def opening(self) -> list[dict]:
        return []

    def chunk(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> dict:
        return self._body(text, None, self._legacy(logprobs))

    def finish(self, finish_reason: str) -> dict:
        return self._body("", finish_reason, None)

    def usage(self, usage: dict) -> dict:
        return self._body("", None, None) | {"choices": [], "usage": usage}

    def answer(self, text: str, finish_reason: str, usage: dict, logprobs: Sequence[TokenLogprob] | None) -> dict:
        return self._body(text, finish_reason, self._legacy(logprobs)) | {"usage": usage}


Shape = ChatShape | CompletionShape
