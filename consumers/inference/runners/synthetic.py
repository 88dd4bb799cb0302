"""The synthetic requests a runner times its engine's steps with (the profile it runs
before it serves, its idle probes): greedy, their end of sequence barred so they decode
every step asked, out of the prefix cache, their outputs dropped."""

from __future__ import annotations

import time
from contextlib import suppress

from consumers.inference.engine.sampling import SamplingParams
from consumers.inference.engine_io import EngineBackend, GenRequest, StepOutput, TextPrompt

#: What their prompt is cut from.
PROMPT = "Tell me about the weather in the mountains"


class SyntheticRequests:
    """The synthetic requests in an engine now (true while there are any), each id
    ``prefix`` and a unique tail; their prompt is ``prompt_tokens`` tokens."""

    def __init__(self, prefix: str, prompt_tokens: int) -> None:
        self.prefix = prefix
        self.prompt_tokens = prompt_tokens
        self.ids: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.ids)

    def add(self, engine: EngineBackend, n: int, steps: int) -> None:
        """``n`` requests of ``steps`` decode steps each into ``engine``."""
        loaded = engine.loaded
        ids = [f"{self.prefix}{n}-{i}-{time.monotonic_ns()}" for i in range(n)]
        self.ids.update(ids)
        if (upstream := loaded.spec.upstream) is not None:  # a server that tokenizes: the prompt as text
            # Its vocabulary is unknown and `ignore_eos` an extension a hosted API refuses,
            # so its end of sequence is not barred: a prompt answered at length.
            text = (
                TextPrompt(messages=[{"role": "user", "content": PROMPT}])
                if "chat" in upstream.endpoints
                else TextPrompt(text=PROMPT + ":")
            )
            params = SamplingParams(temperature=0, max_tokens=steps + 1)
            for rid in ids:
                engine.add(GenRequest(rid, [], params, cache=False, text_prompt=text))
            return
        prompt = loaded.tokenizer.encode(PROMPT, add_special_tokens=False)
        params = SamplingParams(
            temperature=0,
            max_tokens=steps + 1,
            logit_bias=tuple((eos, -100.0) for eos in loaded.eos_ids),
        )
        for rid in ids:
            engine.add(GenRequest(rid, prompt[: self.prompt_tokens], params, cache=False))

    def strip(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """A step's outputs less theirs (whose finished ones leave the set)."""
        mine = {o.request_id for o in outputs if o.request_id in self.ids}
        if not mine:
            return outputs
        self.ids -= {o.request_id for o in outputs if o.request_id in mine and o.finished}
        return [o for o in outputs if o.request_id not in mine]

    def end(self, engine: EngineBackend) -> None:
        """Cancel those still running; their last outputs are dropped."""
        for rid in self.ids:
            engine.cancel(rid)
        with suppress(Exception):
            self.strip(engine.step())
        self.ids.clear()
