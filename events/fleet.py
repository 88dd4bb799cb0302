"""What the processes tell each other about themselves: heartbeats and the load they carry.

Every consumer process publishes a heartbeat each `heartbeat_s` on core NATS
(`subjects.heartbeat_subject`): not stored, so never replayed, only read live by the
gateways (readiness, the fleet's series, variants' defaults and, above all, admission
control: `ModelLoad` is what a gateway judges a new request's finish time by) and by
`arena up`'s takeover (the ack subjects a dead worker held).

The wire format is the models' JSON, flat (the keys the dict beats had before these
models, so a gateway and a worker of either side of a deploy read each other's beats).
Unlike an event, a beat ignores fields it does not know instead of refusing them: a
process of a newer contract may add one, and a gateway that then dropped every beat
would refuse every request. A field changing meaning gets a new `schema_version`.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

BEAT_VERSION = 1


class Beat(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class EngineLoad(Beat):
    """One engine's state after its last step: what it holds and how fast it steps (the
    engine runner's `load()`; an engine process sends it up the pipe with each step)."""

    running: int = Field(0, ge=0, description="Requests in the engine's batch.")
    waiting: int = Field(0, ge=0, description="Requests added to the engine, waiting for a slot in its batch.")
    max_batch: int = Field(0, ge=0, description="The engine's batch size: slots for running requests.")
    step_s: float | None = Field(
        None,
        description="Typical decode step time at small batches (no newcomer's prefill in it); None until measured.",
    )
    full_step_s: float | None = Field(
        None, description="Typical decode step time at near-full batches (the same); None until measured."
    )
    full_batch: int | None = Field(None, description="The batch those near-full steps ran at (their median).")
    small_batch: int | None = Field(None, description="The batch the small-batch steps ran at (their median).")
    alone_step_s: float | None = Field(
        None,
        description="Median decode step with one request in the batch (recent ones; the idle profile's until "
        "those are measured): a token's time for a request served alone; None until measured.",
    )
    prefill_share: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Of the last seconds' step time, the share newcomers' prefills took: a request's decode steps "
        "are stretched by 1 / (1 - share) while others keep arriving (0: none, or idle).",
    )
    recent_running: int = Field(
        0,
        ge=0,
        description="The most requests a served step ran at once in the last 15 s (runtime.steps.PEAK_WINDOW_S): "
        "the batch a request admitted now is judged to live through, if more than the batch of the moment.",
    )
    mean_running: float | None = Field(
        None,
        ge=0.0,
        description="The requests a served step ran at once over the last 15 s, time-weighted, idle time "
        "counted as none (runtime.steps.PEAK_WINDOW_S): the batch a request admitted now shares, on average; "
        "None from a worker that does not say (admission then judges at recent_running).",
    )
    measured_at: float = Field(0.0, description="Epoch seconds of the last measured step (0: none yet).")
    ends: tuple[int, ...] = Field(
        (),
        description="The token budgets the running requests have left, fewest first: when their slots free, for "
        "a request that has to wait for one (empty: none running, or a worker that does not say).",
    )


class ModelLoad(EngineLoad):
    """A model's load on one inference process, summed over its engines (versions) and
    with the token budgets its requests have left: the figures admission control reads."""

    tokens: int = Field(0, ge=0, description="Tokens the model's requests here may still generate, in all.")

    def plus(self, engine: EngineLoad) -> ModelLoad:
        """This load with another engine's or worker's of the same model: counts add, the
        slower step time wins (a worker sums its engines, a gateway the workers)."""
        full = engine.full_step_s is not None and engine.full_step_s >= (self.full_step_s or 0.0)
        small = engine.step_s is not None and engine.step_s >= (self.step_s or 0.0)
        return self.model_copy(
            update={
                "tokens": self.tokens + (engine.tokens if isinstance(engine, ModelLoad) else 0),
                "running": self.running + engine.running,
                "waiting": self.waiting + engine.waiting,
                "recent_running": self.recent_running + engine.recent_running,
                "mean_running": None
                if self.mean_running is None and engine.mean_running is None
                else (self.mean_running or 0.0) + (engine.mean_running or 0.0),
                "max_batch": self.max_batch + engine.max_batch,
                "ends": tuple(sorted(self.ends + engine.ends)),
                "measured_at": max(self.measured_at, engine.measured_at),
                "prefill_share": max(self.prefill_share, engine.prefill_share),
                "step_s": engine.step_s if small else self.step_s,
                "full_step_s": engine.full_step_s if full else self.full_step_s,
                "full_batch": engine.full_batch if full else self.full_batch,
                "small_batch": engine.small_batch if small else self.small_batch,
                # The fastest engine alone: a request too long for it is too long for all.
                "alone_step_s": min(
                    (s for s in (self.alone_step_s, engine.alone_step_s) if s is not None), default=None
                ),
            }
        )


class VariantDefaults(Beat):
    """What a variant (`base:` in the models config) announces: its base and the request
    defaults it sets; the gateway applies them to requests that leave them unset."""

    base: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    system: str | None = None


class ProcessBeat(Beat):
    """What every process says about itself (filter and delivery say no more)."""

    schema_version: int = BEAT_VERSION
    role: str = Field(description="The process's role (`events.topology`).")
    instance: str = Field(description="The process's instance id (settings' `instance_id`).")
    ready: bool = Field(description="Consuming: started, and not draining.")
    ts: float = Field(description="Epoch seconds when the beat was sent; a beat 3 periods old is no longer live.")
    pid: int = Field(description="The process's id (the supervisor hands a dead one's messages on by it).")
    metrics_port: int | None = Field(None, description="Where its /metrics answers.")

    def base(self) -> dict[str, Any]:
        """The fields every beat has, to build a role's beat from this one."""
        return self.model_dump(include=set(ProcessBeat.model_fields) - {"role"})


class InferenceBeat(ProcessBeat):
    """An inference worker's beat: the models it serves and the load each has here."""

    role: Literal["inference"] = "inference"
    engine: str = Field("continuous", description="Its engines' batching: 'static' or 'continuous'.")
    models: tuple[str, ...] = Field((), description="Every model it serves (loaded or not).")
    resident: tuple[str, ...] = Field((), description="The models loaded now.")
    loading: tuple[str, ...] = Field(
        (),
        description="The models `arena models add` is loading now (weights, then a started engine): a gateway "
        "answers a request for one that no worker holds ready 503 model_loading, with Retry-After.",
    )
    unavailable: tuple[str, ...] = Field(
        (),
        description="The upstream models whose server is down here (their circuit is open): a gateway answers "
        "a request for one that no worker holds available 503 model_unavailable at once; the arena pairs them no more.",
    )
    resident_bytes: int = Field(0, ge=0, description="Bytes of the resident models' weights.")
    context: dict[str, int] = Field(
        default_factory=dict, description="Per model: the tokens a request may have (prompt and completion)."
    )
    defaults: dict[str, VariantDefaults] = Field(default_factory=dict, description="Per variant: its defaults.")
    owners: dict[str, str] = Field(default_factory=dict, description="Per model: the owner the arena records.")
    jobs: int = Field(0, ge=0, description="Requests being generated.")
    held: int = Field(0, ge=0, description="Messages pulled and not yet jobs (waiting for room or a model load).")
    acks: tuple[str, ...] = Field((), description="The ack subjects of every message it holds.")
    load: dict[str, ModelLoad] = Field(default_factory=dict, description="Per resident model with an engine.")


class LeaderboardBeat(ProcessBeat):
    """The leaderboard projection's beat: how far it has folded the battle events."""

    role: Literal["leaderboard"] = "leaderboard"
    seq: int = Field(0, ge=0, description="The stream sequence of the last event folded.")


#: The beat model of each role with a beat of its own; others send a `ProcessBeat`.
BEAT_TYPES: dict[str, type[ProcessBeat]] = {
    str(cls.model_fields["role"].default): cls for cls in (InferenceBeat, LeaderboardBeat)
}


def decode_beat(raw: bytes | str) -> ProcessBeat:
    """The beat in `raw`, as its role's model; ValueError when it is none."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError("a heartbeat is a JSON object")
    return BEAT_TYPES.get(str(data.get("role")), ProcessBeat).model_validate(data)


def encode_beat(beat: ProcessBeat) -> bytes:
    """The beat's JSON, less its fields that are None: a reader of the dict beats took a
    variant's `"top_p": null` for a default to apply (the dicts left unset ones out)."""
    return beat.model_dump_json(exclude_none=True).encode()


# ---- gateways' news to each other (core NATS `subjects.GATEWAY_ADMITTED`) -------------------
#
# Sent on the burst's hot path, one message per read of requests, so the wire stays the
# compact JSON the gateways have always exchanged (arrays, not objects): a gateway of either
# side of a deploy reads the other's. These types are what each side sees of it.

AdmissionState = Literal["pass", "pub", "drop"]


class GatewayDemand(Beat):
    """A gateway's recent demand, sent every second (it also says the gateway is alive):
    `{"gateway": ..., "demand": {model: requests per second}}`."""

    gateway: str = Field(description="The sending gateway's name (random per process).")
    demand: dict[str, float] = Field(description="Requests per second per model, lately.")


class GatewayAdmissions(Beat):
    """Requests a gateway let through (`pass`), published (`pub`) or dropped (`drop`):
    `[gateway, model, [[member, tokens], ...], state]`, or `[gateway, model, member, tokens,
    state]` for one request."""

    gateway: str = Field(description="The sending gateway's name.")
    model: str = Field(description="The model the requests asked for.")
    requests: tuple[tuple[str, int], ...] = Field(description="(member, token budget) of each request.")
    state: AdmissionState = Field(description="pass: let through; pub: published; drop: not ahead of anyone.")


GatewayNews = GatewayDemand | GatewayAdmissions


def encode_news(news: GatewayNews) -> bytes:
    if isinstance(news, GatewayDemand):
        return orjson.dumps({"gateway": news.gateway, "demand": news.demand})
    if len(news.requests) == 1 and news.state != "pass":
        ((member, tokens),) = news.requests
        return orjson.dumps([news.gateway, news.model, member, tokens, news.state])
    return orjson.dumps([news.gateway, news.model, [list(r) for r in news.requests], news.state])


def decode_news(raw: bytes | str) -> GatewayNews:
    """A peer's news; ValueError (pydantic's ValidationError is one) when it is not."""
    data = orjson.loads(raw)
    if isinstance(data, dict):
        return GatewayDemand.model_validate(data)
    if not isinstance(data, list) or len(data) not in (4, 5):
        raise ValueError(f"not gateway news: {data!r:.80}")
    if len(data) == 4:
        gateway, model, requests, state = data
    else:
        gateway, model, member, tokens, state = data
        requests = [(member, tokens)]
    return GatewayAdmissions(gateway=gateway, model=model, requests=requests, state=state)
