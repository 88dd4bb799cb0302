"""OpenAI-compatible request models: chat completions and (legacy) completions."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    WithJsonSchema,
    field_validator,
)
from pydantic.json_schema import JsonDict

from events.models import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    MAX_TOKENS_LIMIT,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    PromptFormat,
    SamplingParams,
)


def _encodable(v: str) -> str:
    # JSON may carry lone surrogates ("\\ud800") that no UTF-8 encoder accepts: refuse them
    # here, with the field's name, instead of failing when the event is published.
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (a lone surrogate cannot be encoded)") from None
    return v


#: Every client string: valid Unicode, or 400 naming the field.
Text = Annotated[str, AfterValidator(_encodable)]
#: JSON numbers and integers as the schema says: `true` is not 1.
Number = Annotated[float, Strict()]
#: JSON Schema's integers include 1.0; booleans and strings are not integers.
_integral = BeforeValidator(lambda v: int(v) if isinstance(v, float) and v.is_integer() else v)
#: The largest seed: JSON numbers past 2**53 lose precision in most clients and validators.
MAX_SEED = 2**53 - 1
# Integer fields, with their bounds inside (outside, the schema would lose them).
Tokens = Annotated[int, Strict(), Field(ge=1, le=MAX_TOKENS_LIMIT), _integral]
Seed = Annotated[int, Strict(), Field(ge=0, le=MAX_SEED), _integral]
TurnId = Annotated[int, Strict(), Field(ge=0), _integral]
#: A conversation id, as the schema declares it (the pattern admits no surrogate, so it
#: needs no `Text` check; on top of one, pydantic would leave the pattern out of the schema).
ConvId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]


def _sampleable(v: float) -> float:
    if 0 < v < MIN_TEMPERATURE:
        raise ValueError(
            f"must be 0 (greedy) or at least {MIN_TEMPERATURE}: smaller ones leave the sampler nothing to sample"
        )
    return v


#: The temperature every transport accepts.
Temperature = Annotated[
    float,
    Strict(),
    Field(ge=0.0, le=2.0),
    AfterValidator(_sampleable),
    WithJsonSchema(
        {
            "anyOf": [{"type": "number", "enum": [0]}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": 2.0}],
            "description": f"0 (greedy) or from {MIN_TEMPERATURE} to 2.",
        }
    ),
]
#: A time budget in seconds (strict: `true` is not a number).
Deadline = Annotated[
    float,
    Strict(),
    Field(
        gt=0,
        description="Time budget in seconds; default 15, at most 120 (a longer one is cut to it); at least the "
        "admission overhead (0.5 by default), and long enough for the tokens asked for at the model's speed.",
    ),
]
StopText = Annotated[Text, Field(min_length=1)]
#: OpenAI's penalties: -2 to 2, over the tokens generated so far.
Penalty = Annotated[float, Strict(), Field(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Strict(), Field(ge=0, le=MAX_TOP_LOGPROBS), _integral]
#: Most entries a logit_bias may hold (each costs the sampler a little at every step).
MAX_BIASED_TOKENS = 1024
#: OpenAI's default completion length on `POST /v1/completions` (chat's is DEFAULT_MAX_TOKENS).
COMPLETION_MAX_TOKENS = 16


def _bias(v: Any) -> dict[int, float] | None:
    """`{"token id": bias}` as JSON writes it, ids as decimal strings, biases -100 to 100."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValueError("must be an object mapping token ids to biases")
    if len(v) > MAX_BIASED_TOKENS:
        raise ValueError(f"holds {len(v)} tokens; at most {MAX_BIASED_TOKENS}")
    out = {}
    for given, bias in v.items():
        # A request's copy (CompletionRequest.to_chat) has them as ints already.
        key = str(given) if isinstance(given, int) and not isinstance(given, bool) and given >= 0 else given
        if not (isinstance(key, str) and key.isascii() and key.isdecimal()):
            raise ValueError(f"key {key!r} is no token id (a non-negative integer)")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise ValueError(f"token {key}: the bias must be a number from -100 to 100, got {bias!r}")
        out[int(key)] = float(bias)
    return out


LogitBias = Annotated[
    Any,
    AfterValidator(_bias),
    WithJsonSchema(
        {
            "anyOf": [
                {
                    "type": "object",
                    "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                },
                {"type": "null"},
            ],
            "description": "Token id (as a string) -> bias added to its logit, -100 to 100.",
        }
    ),
]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


#: OpenAI request fields that are refused unless neutral: field -> its neutral values
#: (null first, then the one a client sends to mean "none").
UNSERVED: dict[str, tuple] = {
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
}


#: POST /v1/completions' fields refused unless neutral, as UNSERVED.
COMPLETION_UNSERVED: dict[str, tuple] = {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}


def _refuse_unless_neutral(table: dict[str, tuple], v: Any, info) -> None:
    # as JSON Schema's enum compares: `false` is not 0, nor `true` 1
    if not any(v == n and isinstance(v, bool) == isinstance(n, bool) for n in table[info.field_name]):
        raise ValueError(f"is not supported by this server (accepted: {table[info.field_name][1]!r} or null)")


def _neutral_only(table: dict[str, tuple], name: str, description: str) -> Any:
    """An unserved field (any JSON, checked by `_refuse_unless_neutral`), declared in the schema as
    what is accepted: its neutral values, so the schema refuses what the check refuses."""
    return Field(None, description=description, json_schema_extra={"enum": list(table[name])})


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Strict()] = False


class Sampling(BaseModel):
    """What every OpenAI generation request shares: sampling, stop strings, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: Text | None = Field(None, description="Served model name; default: the gateway's default model.")
    temperature: Temperature = DEFAULT_TEMPERATURE
    top_p: Number = Field(DEFAULT_TOP_P, gt=0.0, le=1.0)
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = Field(
        None, description="-2 to 2: subtracted from the logit of every token generated at least once so far."
    )
    frequency_penalty: Penalty | None = Field(
        None, description="-2 to 2: subtracted from a token's logit once per time it was generated so far."
    )
    logit_bias: LogitBias = None
    ignore_eos: Annotated[bool, Strict()] = Field(
        False,
        description="Not OpenAI's (vLLM's and llama.cpp's extension): go on past the model's end-of-sequence "
        "token, to max_tokens or a stop string, as benchmarks ask for answers of a fixed length.",
    )
    n: Annotated[int, Strict(), Field(ge=1, le=1), _integral] = Field(1, description="Only one choice is served.")
    stream: Annotated[bool, Strict()] = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    deadline_s: Deadline | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        return [v] if isinstance(v, str) else (v or [])

    def stop_list(self) -> list[str]:
        return list(self.stop or [])


#: top_logprobs above 0 needs logprobs: true (`_top_needs_logprobs`), as the schema says it.
TOP_NEEDS_LOGPROBS: JsonDict = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


class ChatCompletionRequest(Sampling):
    """The OpenAI chat completion request, plus arenaflow's conversation fields."""

    model_config = ConfigDict(extra="ignore", json_schema_extra=TOP_NEEDS_LOGPROBS)
    #: How the event's messages become the prompt (a completion's are its prompt as it is).
    prompt_format: ClassVar[PromptFormat] = "chat"

    messages: list[Message] = Field(min_length=1, description="Empty contents are accepted (OpenAI does too).")
    max_tokens: Tokens | None = Field(None, description=f"Default {DEFAULT_MAX_TOKENS}.")
    max_completion_tokens: Tokens | None = None
    logprobs: Annotated[bool, Strict()] | None = Field(
        None, description="Each answer token's log probability (the model's log-softmax of its raw logits)."
    )
    top_logprobs: TopLogprobs | None = Field(
        None, description=f"0 to {MAX_TOP_LOGPROBS}: the most likely tokens at each position; needs logprobs."
    )
    conv_id: ConvId | None = Field(None, description="Conversation id (letters, digits, '_' and '-').")
    turn_id: TurnId | None = Field(None, description="Turn index inside the conversation.")
    # OpenAI fields this server does not serve: refused with a 400 naming the field when
    # they ask for anything (their neutral values pass), never accepted and ignored.
    response_format: Any = _neutral_only(UNSERVED, "response_format", 'Not served: only {"type": "text"} is accepted.')
    tools: Any = _neutral_only(UNSERVED, "tools", "No tool calling: only []/null is accepted.")
    tool_choice: Any = _neutral_only(UNSERVED, "tool_choice", 'No tool calling: only "none"/null is accepted.')
    functions: Any = _neutral_only(UNSERVED, "functions", "No function calling: only []/null is accepted.")
    function_call: Any = _neutral_only(UNSERVED, "function_call", 'No function calling: only "none"/null is accepted.')

    @field_validator(*UNSERVED)
    @classmethod
    def _unserved(cls, v, info):
        return _refuse_unless_neutral(UNSERVED, v, info)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def logprob_count(self) -> int | None:
        """The event's `params.logprobs`: None for none, else how many alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, seed: int) -> SamplingParams:
        """The request's sampling, as its event holds it and the engine samples by it."""
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.token_limit(),
            stop=tuple(self.stop_list()),
            seed=seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self.logit_bias or {},
            logprobs=self.logprob_count(),
            ignore_eos=self.ignore_eos,
        )


class TextPromptRequest(ChatCompletionRequest):
    """A completion as the session code serves it: its one user message is the prompt,
    sent to the model as it is, no chat template (see CompletionRequest.to_chat)."""

    prompt_format: ClassVar[PromptFormat] = "text"


class CompletionRequest(Sampling):
    """OpenAI's (legacy) completion request: a plain prompt, no chat template."""

    prompt: Annotated[Any, WithJsonSchema({"type": "string", "minLength": 1})] = Field(
        description="The prompt: one string (a list of strings or of token ids is refused)."
    )
    max_tokens: Tokens = Field(COMPLETION_MAX_TOKENS, description=f"Default {COMPLETION_MAX_TOKENS}, as OpenAI's.")
    logprobs: TopLogprobs | None = Field(
        None, description=f"0 to {MAX_TOP_LOGPROBS}: each token's log probability and this many most likely tokens."
    )
    echo: Any = _neutral_only(COMPLETION_UNSERVED, "echo", "Not served: only false/null is accepted.")
    suffix: Any = _neutral_only(COMPLETION_UNSERVED, "suffix", 'Not served: only ""/null is accepted.')
    best_of: Any = _neutral_only(COMPLETION_UNSERVED, "best_of", "Not served: only 1/null is accepted.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if not isinstance(v, str):
            raise ValueError("must be one string (lists of prompts or of token ids are not served)")
        if not v:
            raise ValueError("must not be empty")
        return _encodable(v)

    @field_validator(*COMPLETION_UNSERVED)
    @classmethod
    def _unserved(cls, v, info):
        return _refuse_unless_neutral(COMPLETION_UNSERVED, v, info)

    def to_chat(self) -> TextPromptRequest:
        """The request as the session code (ChatService) serves every transport's."""
        fields = self.model_dump(exclude={"prompt", "max_tokens", "logprobs", *COMPLETION_UNSERVED}, exclude_unset=True)
        return TextPromptRequest(
            messages=[Message(role="user", content=self.prompt)],
            max_tokens=self.max_tokens,
            logprobs=self.logprobs is not None or None,
            top_logprobs=self.logprobs,
            **fields,
        )
