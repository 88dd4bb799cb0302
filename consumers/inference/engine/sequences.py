"""A running request's row and what a step does to it after the forward pass: one
token selected per row (from the row's own draws: a row's tokens do not depend on its
batch), its log probability, the text it adds, and whether it ends there. A row that
cannot be sampled or detokenized ends alone, with "error"."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from consumers.inference.engine.prefix import Hit
from consumers.inference.engine.sampling import (
    TextTracker,
    TokenLogprob,
    draw_uniforms,
    make_generator,
    pick_tokens,
    token_logprobs,
)
from consumers.inference.engine_io import FinishReason, GenRequest, StepOutput
from consumers.inference.model_loading import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class Seq:
    req: GenRequest
    max_tokens: int
    generator: torch.Generator | None
    tracker: TextTracker
    tokens: list[int]
    next_pos: int  # position id of the next token fed to the model
    prefix: Hit | None = None  # keys and values of its first tokens, from the prefix cache

    def output(
        self, new: list[int], text: str, reason: FinishReason | None, logprobs: list[TokenLogprob] | None = None
    ) -> StepOutput:
        if reason is not None and reason != "error":  # a failed row's tracker may be what broke
            text += self.tracker.flush()
        return StepOutput(
            request_id=self.req.request_id,
            new_token_ids=new,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(self.req.prompt_ids),
            completion_tokens=len(self.tokens),
            logprobs=logprobs if self.req.params.logprobs is not None else None,
        )


class Sampler:
    """Turns a step's last logits into each row's next token and output, for one model."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.eos = set(loaded.eos_ids)

    def new_seq(self, req: GenRequest, prefix: Hit | None = None) -> Seq:
        room = self.loaded.context_len - len(req.prompt_ids)
        seq = Seq(
            req=req,
            max_tokens=min(req.params.max_tokens, room),
            generator=make_generator(req.params),
            tracker=TextTracker(self.loaded.tokenizer, req.prompt_ids, req.params.stop),
            tokens=list(req.resume_ids),
            next_pos=len(req.input_ids),
            prefix=prefix,
        )
        # Where the first worker was: one draw per token taken, the text already emitted.
        for tok in req.resume_ids:
            draw_uniforms([req.params], [seq.generator])
            seq.tracker.add(tok)
        return seq

    def already_done(self, seq: Seq) -> FinishReason | None:
        """A resumed request whose delivered tokens already end it (the first worker died
        between its last chunk and its terminal event)."""
        if not seq.tokens:
            return None
        if self.ends(seq, seq.tokens[-1]):
            return "stop"
        return "length" if len(seq.tokens) >= seq.max_tokens else None

    def advance(self, seqs: list[Seq], logits: torch.Tensor) -> tuple[list[StepOutput], list[int]]:
        """Sample one token per sequence; return outputs and the indices still running."""
        outputs, alive = [], []
        tokens = self.select(seqs, logits)
        logprobs = self.logprobs(seqs, logits, tokens)
        for i, (seq, tok, lp) in enumerate(zip(seqs, tokens, logprobs, strict=True)):
            out = self.append(seq, tok, lp)
            outputs.append(out)
            if not out.finished:
                alive.append(i)
        return outputs, alive

    @staticmethod
    def select(seqs: list[Seq], logits: torch.Tensor) -> list[int | None]:
        """One token per row, None for a row that cannot be sampled; draws are taken once."""
        params = [s.req.params for s in seqs]
        uniforms = draw_uniforms(params, [s.generator for s in seqs])
        generated = [s.tokens for s in seqs]
        try:
            return pick_tokens(logits, params, uniforms, generated)
        except Exception:
            log.exception("token selection failed for %d requests; selecting row by row", len(seqs))
        tokens: list[int | None] = []
        for i, (p, u) in enumerate(zip(params, uniforms, strict=True)):
            try:
                tokens += pick_tokens(logits[i : i + 1], [p], [u], generated[i : i + 1])
            except Exception:
                log.exception("request %s: token selection failed", seqs[i].req.request_id)
                tokens.append(None)
        return tokens

    @staticmethod
    def logprobs(seqs: list[Seq], logits: torch.Tensor, tokens: list[int | None]) -> list[TokenLogprob | None]:
        """The chosen tokens' log probabilities, for the rows that ask (a failure costs
        the row its token: it ends with "error", its neighbours unaffected)."""
        params = [s.req.params for s in seqs]
        try:
            return token_logprobs(logits, params, tokens)
        except Exception:
            log.exception("log probabilities failed for %d requests; ending those that asked", len(seqs))
        for i, p in enumerate(params):
            if p.logprobs is not None:
                tokens[i] = None
        return [None] * len(seqs)

    def append(self, seq: Seq, tok: int | None, logprob: TokenLogprob | None = None) -> StepOutput:
        if tok is None:
            log.error("request %s: no token could be selected; ending it with an error", seq.req.request_id)
            return seq.output([], "", "error")
        seq.tokens.append(tok)
        try:
            text = seq.tracker.add(tok)
        except Exception:
            log.exception("request %s: detokenizing failed; ending it with an error", seq.req.request_id)
            return seq.output([], "", "error")
        reason: FinishReason | None = None
        if self.ends(seq, tok):
            reason = "stop"
        elif len(seq.tokens) >= seq.max_tokens:
            reason = "length"
        # The end-of-sequence token is no part of the answer's text: no entry for it.
        return seq.output([tok], text, reason, [logprob] if logprob is not None and tok not in self.eos else [])

    def ends(self, seq: Seq, tok: int) -> bool:
        """The request stops at ``tok``: the end of sequence (unless it asked to go on past
        it) or a stop string its text now holds."""
        return (tok in self.eos and not seq.req.params.ignore_eos) or seq.tracker.stopped
