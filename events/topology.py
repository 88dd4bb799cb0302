"""The pipeline's topology, declared once: its process roles, their durable consumers,
what each reads and publishes, and how each process is started.

Everything else reads this declaration: JetStream set-up (`runtime.jetstream`), the
gateway's readiness (`/readyz`), `arena run` / `arena up` (which roles exist, in which
order they start and stop) and the AsyncAPI document. Adding a consumer is one `Role`
entry here plus its app module.
"""

from __future__ import annotations

from dataclasses import dataclass

from events import battles as b
from events import models as m
from events import subjects as s


@dataclass(frozen=True)
class Role:
    """One kind of process."""

    name: str
    #: "module:function" that runs the process (blocking); `arena run <name>` calls it.
    entry: str
    #: The durable pull consumer's filter subject; None for a role that reads no durable.
    reads: str | None = None
    #: Narrower filter subjects (all within `reads`) for the durable, when one subject cannot say it.
    filters: tuple[str, ...] = ()
    #: Event models it reads, for the AsyncAPI document (empty: any output event).
    consumes: tuple[type[m.EventBase], ...] = ()
    #: (event model, subject stem) it publishes.
    publishes: tuple[tuple[type[m.EventBase], str], ...] = ()
    #: AckWait of its durable; None takes the settings' `ack_wait_s` (kept alive by in-progress acks).
    ack_wait_s: float | None = 30.0
    max_deliver: int = 20
    #: Bound the group's unacked messages by the settings' `max_ack_pending`.
    bounded: bool = False
    #: /readyz needs at least one live, ready process of this role.
    required: bool = True
    #: Scaled by `arena up --inference-replicas` (and its own torch threads).
    replicated: bool = False

    @property
    def durable(self) -> str | None:
        """The durable consumer's name (the role's name), if it reads one."""
        return self.name if self.reads else None


FILTER = Role(
    name="filter",
    entry="consumers.filter.app:main",
    reads=s.FILTER_SUBJECT,
    consumes=(m.ChatRequested,),
    publishes=((m.PromptAccepted, s.ACCEPTED), (m.PromptRejected, s.REJECTED)),
    max_deliver=10,
)
# max_deliver: delivery naks with a 2 s delay while Redis is unreachable (about two minutes in all).
DELIVERY = Role(
    name="delivery",
    entry="consumers.delivery.app:main",
    reads=s.DELIVERY_SUBJECT,
    filters=s.DELIVERY_FILTERS,
    max_deliver=60,
)
INFERENCE = Role(
    name="inference",
    entry="consumers.inference.app:main",
    reads=s.INFERENCE_SUBJECT,
    consumes=(m.PromptAccepted,),
    publishes=((m.TokensGenerated, s.TOKENS), (m.ChatCompleted, s.COMPLETED), (m.ChatFailed, s.FAILED)),
    ack_wait_s=None,
    bounded=True,
    replicated=True,
)
LEADERBOARD = Role(
    name="leaderboard",
    entry="consumers.leaderboard.app:main",
    reads=f"{s.BATTLE_PREFIX}.>",
    consumes=(b.BattleStarted, b.VoteCast, b.VoteInvalidated, b.VoteReinstated, b.ModelWithdrawn, b.ModelReinstated),
    # The gateway serves the last stored leaderboard without it.
    required=False,
)
GATEWAY = Role(
    name="gateway",
    entry="gateway.app:main",
    publishes=(
        (m.ChatRequested, s.REQUESTED),
        (m.ChatCancelled, s.CANCELLED),
        (b.BattleStarted, b.STARTED),
        (b.BattleTurn, b.TURN),
        (b.VoteCast, b.VOTED),
        (b.VoteInvalidated, b.INVALIDATED),
    ),
    required=False,
)

#: In start order; `arena up` stops them in the reverse order, so the gateway stops
#: taking requests first, inference drains while delivery still delivers, and the
#: servers go last.
ROLES: list[Role] = [FILTER, DELIVERY, INFERENCE, LEADERBOARD, GATEWAY]


def role(name: str) -> Role:
    for r in ROLES:
        if r.name == name:
            return r
    raise KeyError(f"no role {name!r}; roles: {', '.join(r.name for r in ROLES)}")


def role_names() -> list[str]:
    return [r.name for r in ROLES]


def consumers() -> list[Role]:
    """Roles that read a durable consumer."""
    return [r for r in ROLES if r.reads]


def required() -> list[str]:
    """Roles whose heartbeats /readyz waits for."""
    return [r.name for r in ROLES if r.required]
