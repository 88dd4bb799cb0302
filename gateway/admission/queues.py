"""Admission's view of the fleet, from the typed heartbeats (events/fleet.py): a model's
queue as the inference workers holding it report it (pure; `Pipeline.queue` feeds it
the beats it has heard)."""

from __future__ import annotations

from collections.abc import Iterable

from events.fleet import InferenceBeat, ModelLoad, ProcessBeat
from gateway.admission.estimate import ModelQueue

#: How long a worker's last heartbeat still counts for admission once it is late and no
#: live one holds the model (`model_queue`).
LATE_BEAT_S = 30.0


def queue_of(model: str, beats: Iterable[ProcessBeat]) -> ModelQueue:
    """The model's queue summed over the inference beats that hold it resident."""
    total, held, heard_at = ModelLoad(), 0, 0.0
    for beat in beats:
        if isinstance(beat, InferenceBeat) and model in beat.resident and model in beat.load:
            total, held = total.plus(beat.load[model]), held + beat.held
            heard_at = max(heard_at, beat.ts)
    requests = total.running + total.waiting + held
    return ModelQueue(
        total.max_batch,
        requests,
        total.tokens,
        total.step_s,
        total.full_step_s,
        total.measured_at,
        total.full_batch,
        total.alone_step_s,
        total.small_batch,
        total.prefill_share,
        heard_at,
        total.recent_running,
        total.ends,
        total.mean_running,
    )


def model_queue(model: str, live: Iterable[ProcessBeat], heard: Iterable[ProcessBeat], now: float) -> ModelQueue:
    """What the inference workers holding the model report in their `live` heartbeats.
    When none holds it, the last ones `heard` of up to LATE_BEAT_S ago do: a worker whose
    beats are late (its process busy or starved) still holds the model, and with no
    slots at all admission would take the model for one never run and let a whole burst
    through."""
    q = queue_of(model, live)
    if q.slots == 0:
        q = queue_of(model, [b for b in heard if b.ts >= now - LATE_BEAT_S])
    return q
