"""Summaries of a run's request records: throughput, percentiles, error rates."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(values: Iterable[float | None], prefix: str) -> dict[str, float | None]:
    """`{prefix}_p50`, `_p95`, `_p99` of the values that are not None."""
    present = [v for v in values if v is not None]
    return {f"{prefix}_p{q}": percentile(present, q) for q in (50, 95, 99)}


def summarize(records: Sequence[dict], wall_s: float) -> dict:
    """One row of figures for a load level, from `RequestRecord.as_json()` rows.

    Throughput counts completed requests over the level's wall time, which runs from
    the first request sent to the last answer received.
    """
    ok = [r for r in records if r["status"] == "ok"]
    total = len(records)
    tokens = sum(r["output_tokens"] for r in ok)
    wall = max(wall_s, 1e-9)
    return {
        "requests": total,
        "completed": len(ok),
        "errors": sum(r["status"] == "error" for r in records),
        "rejected": sum(r["status"] == "rejected" for r in records),
        "error_rate": (total - len(ok)) / total if total else None,
        "rejection_rate": sum(r["status"] == "rejected" for r in records) / total if total else None,
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall,
        "tokens_per_s": tokens / wall,
        "output_tokens": tokens,
        "mean_output_tokens": tokens / len(ok) if ok else None,
        **spread((r["latency_s"] for r in ok), "latency"),
        **spread((r["ttft_s"] for r in ok), "ttft"),
    }
