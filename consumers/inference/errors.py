"""Error hierarchy of the inference consumer.

Decided once, here: a ``PermanentError`` will fail the same way on every retry, so
the consumer turns it into a failure event and a client error; a ``RetryableError``
is transient (capacity, a model still loading) and the message is nak'ed with a delay.
"""

from __future__ import annotations


class InferenceError(Exception):
    """Base class of every error raised by the inference core."""


class PermanentError(InferenceError):
    """The request cannot succeed as sent; do not redeliver it."""


class RetryableError(InferenceError):
    """A transient condition; the same request may succeed later."""


class UnknownModel(PermanentError):
    """The requested model name is not configured in the pool."""

    def __init__(self, name: str, known: list[str] | None = None) -> None:
        self.name = name
        self.known = list(known or [])
        hint = f"; configured models: {', '.join(self.known)}" if self.known else ""
        super().__init__(f"unknown model {name!r}{hint}")


class Unsupported(PermanentError):
    """A request field the model's server does not take (the models config says so): the
    client's 400, naming the field."""

    def __init__(self, field: str, model: str, why: str = "its upstream server does not support it") -> None:
        self.field = field
        super().__init__(f"{field}: model {model!r} cannot serve it: {why}")


class Unavailable(PermanentError):
    """The model's server is known to be down (its circuit is open): refused at once, a
    503 with when to ask again, rather than held until its deadline."""

    def __init__(self, model: str, why: str, retry_in_s: float) -> None:
        self.retry_in_s = retry_in_s
        super().__init__(f"model {model!r} is unavailable: {why}; retry in {retry_in_s:.0f} s")


class PromptTooLong(PermanentError):
    """The prompt does not fit the model's context window."""

    def __init__(self, prompt_tokens: int, context_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_len = context_len
        super().__init__(
            f"messages: the prompt has {prompt_tokens} tokens but the model's context is "
            f"{context_len} tokens (at least one must be left for the completion); "
            "shorten the conversation"
        )


class ContextExceeded(PromptTooLong):
    """The prompt fits the context, but not with the completion asked for."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_len = context_len
        PermanentError.__init__(
            self,
            f"max_tokens: the prompt's {prompt_tokens} tokens and max_tokens {max_tokens} are over the "
            f"model's context of {context_len} tokens; ask for at most {context_len - prompt_tokens} "
            "or shorten the conversation",
        )


class KVBudgetExceeded(PromptTooLong):
    """The request fits the context, but its keys and values alone would be over the
    worker's KV cache budget: it could never join a batch."""

    def __init__(self, prompt_tokens: int, max_tokens: int, room: int, budget_mb: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.context_len = room
        PermanentError.__init__(
            self,
            f"max_tokens: the prompt's {prompt_tokens} tokens and max_tokens {max_tokens} are over the "
            f"{room} tokens a request's keys and values may take in this worker's KV cache "
            f"(ARENA_KV_CACHE_MB={budget_mb:g}); ask for at most {room - prompt_tokens} or shorten the conversation",
        )


class PoolExhausted(RetryableError):
    """No model can be evicted to make room: every resident model is in use.

    Retry after in-flight requests finish, or raise the pool's memory budget.
    """
