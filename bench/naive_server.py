"""The naive baseline: HTTP plus `model.generate`, one request at a time.

    python -m bench.naive_server --model .arena/models/llama-60m --port 8100

OpenAI-compatible `POST /v1/chat/completions` (plain and SSE streaming), `GET /readyz`
and `GET /v1/models`. An asyncio.Lock admits one request at a time; generation runs
in a worker thread so the event loop keeps answering (and notices disconnects, which
stop the generation at the next step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from bench import hf


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(BaseModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(128, ge=1, le=2048)
    stream: bool = False
    ignore_eos: bool = False
    temperature: float | None = None  # accepted; decoding is greedy
    stream_options: dict | None = None


def _chunk(rid: str, model: str, delta: dict | None, finish: str | None = None, usage=None) -> str:
    body = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def create_app(model_path: str, name: str | None = None, dtype: str = "float32") -> FastAPI:
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["lm"] = await asyncio.to_thread(hf.load, model_path, name, dtype)
        state["lock"] = asyncio.Lock()
        yield
        state.clear()

    app = FastAPI(title="naive baseline", lifespan=lifespan)

    @app.get("/readyz")
    async def readyz() -> dict:
        return {"status": "ready"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state["lm"].name, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        lm: hf.LoadedModel = state["lm"]
        if req.model != lm.name:
            raise HTTPException(404, f"model {req.model!r} is not served; this server has {lm.name!r}")
        prompt = hf.render(lm.tokenizer, [m.model_dump() for m in req.messages])
        batch = hf.encode(lm, [prompt])
        rid = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        if req.stream:
            return StreamingResponse(_stream(lm, state["lock"], req, batch, rid), media_type="text/event-stream")
        async with state["lock"]:
            new = await asyncio.to_thread(hf.generate, lm, batch, req.max_tokens, req.ignore_eos)
        ids = new[0].tolist()
        text = lm.tokenizer.decode(ids, skip_special_tokens=True)
        n_prompt = batch["input_ids"].shape[1]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": lm.name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length" if len(ids) >= req.max_tokens else "stop",
                }
            ],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)},
        }

    return app


async def _stream(lm: hf.LoadedModel, lock: asyncio.Lock, req: ChatCompletionRequest, batch, rid: str):
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()
    timer = hf.TokenTimer(on_tokens=lambda ids: loop.call_soon_threadsafe(queue.put_nowait, ids))
    async with lock:
        timer.started = time.perf_counter()
        work = asyncio.create_task(
            asyncio.to_thread(hf.generate, lm, batch, req.max_tokens, req.ignore_eos, timer, cancel)
        )
        try:
            yield _chunk(rid, lm.name, {"role": "assistant", "content": ""})
            ids: list[int] = []
            sent = ""
            while (step := await queue.get()) is not None:
                ids.extend(step)
                text = lm.tokenizer.decode(ids, skip_special_tokens=True)
                delta, sent = text[len(sent) :], text
                yield _chunk(rid, lm.name, {"content": delta})
            await work
            n_prompt = batch["input_ids"].shape[1]
            finish = "length" if len(ids) >= req.max_tokens else "stop"
            yield _chunk(rid, lm.name, {}, finish)
            if (req.stream_options or {}).get("include_usage"):
                usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)}
                yield _chunk(rid, lm.name, None, usage=usage)
            yield "data: [DONE]\n\n"
        finally:
            # Client gone or done: stop the generation, and hold the lock until it has.
            cancel.set()
            await asyncio.shield(work)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--name", help="served model name (default: the directory's name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    uvicorn.run(create_app(args.model, args.name, args.dtype), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
