"""The engine's contract: what a model engine takes and gives, and the messages of the
engine-process pipe (as vLLM's ``EngineCoreRequest`` / ``EngineCoreOutputs`` /
``SchedulerStats``).

**An engine backend** (:class:`EngineBackend`) generates for many requests of one model.
The built-in :class:`~consumers.inference.engine.batch.BatchEngine` is one; another (llama.cpp,
say: ``consumers/inference/llamacpp/engine.py``) plugs in by implementing these members, and the runners (a thread,
:class:`~consumers.inference.runners.thread.EngineRunner`, or a child process,
:class:`~consumers.inference.runners.process.ProcessRunner`) drive it unchanged:

- ``add(req)``: queue a :class:`GenRequest`; thread-safe. Raise ``PromptTooLong`` or
  ``PermanentError`` (``consumers.inference.errors``) for one that can never run.
- ``cancel(request_id)``: finish it with ``"cancelled"`` at the next step; thread-safe,
  unknown ids ignored.
- ``step()``: one step of every request held (decode, admit newcomers); returns what each
  produced (:class:`StepOutput`). Called from one thread only, the runner's.
- ``fail_all()``: after ``step()`` raised: finish everything held with ``"error"`` and reset.
- ``stats()``: the token budgets left of the requests running and waiting (admission
  estimates finish times from them) and the prefix cache's counts; any thread.
- ``max_batch_size``: the slots (requests stepped at once); ``loaded``: the model it
  steps (the pool's handle: the runner is keyed by it, the service reads its tokenizer).
- ``close()``: let go of what it holds beyond this process's memory (the llama.cpp
  engine's server child); the runner calls it when it stops.

Every request added gets exactly one output with ``finished`` set, whatever happens
(stop, length, deadline, cancelled, error); the deadline (``GenRequest.deadline``) is
the engine's to enforce. Outputs carry text incrementally, never a split character.

**The pipe** between the consumer and its engine process carries these dataclasses
(pickled, as ``multiprocessing`` does): down, an :data:`EngineCommand`; up, an
:data:`EngineMessage`. It never leaves the inference package, so it lives here and not in
``events/``: both ends are this package's code, started together, and no other process
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

from consumers.inference.engine.prefix import PrefixStats
from consumers.inference.engine.sampling import SamplingParams, TokenLogprob
from events.fleet import EngineLoad
from events.models import FailureCode

if TYPE_CHECKING:
    from consumers.inference.model_loading import LoadedModel

#: "lost": the engine process running it died (engine_process.py); the worker gives
#: the request back, to be continued from its stored chunks, instead of failing it.
FinishReason = Literal["stop", "length", "deadline", "cancelled", "error", "lost"]


@dataclass(frozen=True)
class TextPrompt:
    """A prompt as text, for a server that tokenizes it itself (an upstream backend's):
    chat messages, or a completions prompt; and the answer's text already delivered (a
    request taken over from a dead worker), to continue from."""

    messages: list[dict] | None = None
    text: str | None = None
    resumed: str = ""


@dataclass
class GenRequest:
    """One completion to generate from already-tokenized prompt ids."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None = None  # wall-clock epoch seconds (time.time()); None: no deadline
    #: Tokens already generated and delivered for it (a request taken over from a dead
    #: worker): prefilled with the prompt, its sampler advanced past them, then continued.
    resume_ids: list[int] = field(default_factory=list)
    admitted_at: float | None = None  # when it joined a batch (its prefill began), by the engine's clock
    #: Looked up in and kept in the prefix cache; False for prompts that are no one's (the
    #: runner's step profile), which must neither count as misses nor push entries out.
    cache: bool = True
    #: For an engine that takes text (``prompt_ids`` then empty): the prompt as text.
    text_prompt: TextPrompt | None = None

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.resume_ids


@dataclass
class StepOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]  # includes an EOS token when the model emitted one
    new_text: str  # incremental text; never splits a character or shows a partial stop string
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int  # total so far
    #: With ``params.logprobs``: one per new token, less an end-of-sequence one; else None.
    logprobs: list[TokenLogprob] | None = None
    #: Of an "error" the engine can say more of: the failure's code and message for the client.
    failure: tuple[FailureCode, str] | None = None

    @classmethod
    def ended(cls, req: GenRequest, reason: FinishReason) -> StepOutput:
        """The last output of a request that ends before it generated anything here."""
        return cls(req.request_id, [], "", True, reason, len(req.prompt_ids), 0)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """An engine's queue now: the token budgets left of each running request and of each
    waiting one, in order (upper bounds: a request may stop early)."""

    running: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    prefix: PrefixStats | None = None  # the prefix cache's totals; None without one
    #: Its layers are as it steps them (BatchEngine's packing, if any, done and in place).
    packing_done: bool = True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)


class EngineBackend(Protocol):
    """A stepping engine for one model (see the module's docstring)."""

    @property
    def loaded(self) -> LoadedModel: ...

    @property
    def max_batch_size(self) -> int: ...

    def add(self, req: GenRequest) -> None: ...

    def cancel(self, request_id: str) -> None: ...

    def step(self) -> list[StepOutput]: ...

    def fail_all(self) -> list[StepOutput]: ...

    def stats(self) -> EngineStats: ...

    def timed_steps(self) -> list[tuple[int, float, bool]] | None:
        """The decode steps the engine timed itself since the last call, as (batch,
        seconds, whether newcomers' prefills were in it): a backend whose `step()` only
        reads what a server stepped (llama.cpp's) times the server's steps by the tokens'
        arrivals. None: every `step()` is one step, and the runner times it."""
        ...

    def wait_packed(self, timeout: float | None = None) -> bool:
        """Wait until its layers are as it will step them (a built-in engine packs them on
        a thread while it serves): the runner's step profile times those. True when they
        are (at once for a backend that packs nothing)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A runner's state after a step: its engine's queue, its load (as heartbeats carry it)
    and how many steps its step times rest on (small and near-full batches)."""

    engine: EngineStats
    load: EngineLoad
    samples: tuple[int, int]


class StepRecord(NamedTuple):
    """One engine step, for the worker's metrics."""

    batch: int  # requests it stepped
    running: int  # after it
    waiting: int
    threads: int = 0  # torch threads it took, where the engine sizes them to the load (cores.py); 0: not told


# ---- down the pipe: the consumer's commands ------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    req: GenRequest


@dataclass(frozen=True, slots=True)
class CancelRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class StopEngine:
    pass


EngineCommand = AddRequest | CancelRequest | StopEngine


# ---- up the pipe: the engine process's news ------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineReady:
    """The engine process has its model and steps."""

    stats: SchedulerStats


@dataclass(frozen=True, slots=True)
class EngineOutputs:
    """A step's outputs (several steps', when they piled up), with the state after them."""

    outputs: list[StepOutput]
    stats: SchedulerStats
    #: The steps since the last message.
    steps: list[StepRecord] = field(default_factory=list)
    #: When each request that joined a batch since the last message did (its prefill
    #: began, by the engine's clock): the worker's trace spans it.
    joined: dict[str, float] = field(default_factory=dict)


EngineMessage = EngineReady | EngineOutputs
