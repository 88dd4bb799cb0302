"""`arena filter-eval`'s report: the figures (per stage, by source and family) and how they
are printed, as text tables and as JSON, from one object so the two always agree."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RULES", "SERVED", "EvalReport", "Holdout", "Rates", "StageRates", "astuple", "format_report", "to_json"]

SERVED = "served"
RULES = "rules"


@dataclass(frozen=True)
class Rates:
    """Counts for one slice of the corpus (weights are 1 except when length-matched)."""

    attacks: float = 0.0
    attacks_caught: float = 0.0  # rejected or sanitized
    attacks_rejected: float = 0.0
    benign: float = 0.0
    benign_flagged: float = 0.0  # rejected or altered
    benign_rejected: float = 0.0

    @property
    def catch_rate(self) -> float | None:
        return self.attacks_caught / self.attacks if self.attacks else None

    @property
    def false_positive_rate(self) -> float | None:
        return self.benign_flagged / self.benign if self.benign else None

    def plus(self, other: Rates, weight: float = 1.0) -> Rates:
        return Rates(*(a + weight * b for a, b in zip(astuple(self), astuple(other), strict=True)))


def astuple(r: Rates) -> tuple[float, ...]:
    return (r.attacks, r.attacks_caught, r.attacks_rejected, r.benign, r.benign_flagged, r.benign_rejected)


@dataclass(frozen=True)
class StageRates:
    """One stage's (or the served filter's) figures over the corpus."""

    by_source: dict[str, Rates]
    by_family: dict[str, Rates]
    overall: Rates


@dataclass(frozen=True)
class Holdout:
    """The rules' threshold set on ``train`` families, figures measured on ``test`` families."""

    train: tuple[str, ...]
    test: tuple[str, ...]
    threshold: float
    train_rates: Rates
    test_rates: Rates


@dataclass
class EvalReport:
    """Everything :func:`format_report` prints and :func:`to_json` writes."""

    path: str
    mode: str
    reject_threshold: float
    classifier: dict[str, Any] | None  # the served classifier: version, threshold (None: rules only)
    stages: dict[str, StageRates]  # "served" first, then "rules", then each classifier stage
    length_matched: Rates  # served
    length_matched_by_family: dict[str, Rates]
    rules_holdout: list[Holdout] = field(default_factory=list)
    false_positives: list[dict] = field(default_factory=list)  # benign prompts the served filter changed
    recorded: dict[str, Any] = field(default_factory=dict)  # held-out tables recorded at training

    @property
    def served(self) -> StageRates:
        return self.stages[SERVED]

    @property
    def by_source(self) -> dict[str, Rates]:
        return self.served.by_source

    @property
    def by_family(self) -> dict[str, Rates]:
        return self.served.by_family

    @property
    def overall(self) -> Rates:
        return self.served.overall


def _pct(x: float | None) -> str:
    """A rate as the text report prints it (the JSON has the unrounded value)."""
    return "-" if x is None else f"{100 * x:.2f}%"


def _cells(r: Rates) -> str:
    return f"{_pct(r.catch_rate):>8} {_pct(r.false_positive_rate):>8}"


def _table(report: EvalReport, key: str) -> list[str]:
    """One line per slice: counts, then caught and FP of the served filter and of every stage."""
    names = list(report.stages)
    slices = getattr(report.served, key) if key != "overall" else {"all": report.overall}
    width = max([24, *map(len, slices)])  # whole names: a script may read a line by its slice
    head = f"{'slice':<{width}} {'attacks':>7} {'benign':>7}" + "".join(
        f" | {n + ' caught':>8} {'FP':>8}" for n in names
    )
    out = [head]
    for name, served in slices.items():
        per = [report.stages[n].overall if key == "overall" else getattr(report.stages[n], key)[name] for n in names]
        out.append(
            f"{name:<{width}} {served.attacks:7.0f} {served.benign:7.0f}" + "".join(f" | {_cells(r)}" for r in per)
        )
    return out


def format_report(report: EvalReport) -> str:
    """The report as plain-text tables (the same figures as :func:`to_json`, rounded to 0.01%)."""
    clf = report.classifier
    served = "rules only"
    if clf is not None:
        stages = ", ".join(
            f"{s['name']} {s['version']} ({s['mode']}, threshold {s['threshold']:.4f})" for s in clf["stages"]
        )
        served = f"rules, then {clf['version']}: {stages}" if len(clf["stages"]) > 1 else f"rules, then {stages}"
    out = [
        f"filter evaluation of {report.path}: the served filter, mode {report.mode}, {served},"
        f" reject_threshold {report.reject_threshold}",
        "caught = rejected or sanitized; FP = benign rejected or altered; a classifier stage alone: flagged",
        "",
        "-- overall",
        *_table(report, "overall"),
        "-- by family",
        *_table(report, "by_family"),
        "-- by source",
        *_table(report, "by_source"),
        "-- length-matched, served (log2 length bins, each weighted by min(attacks, benign))",
        f"{'all':<60} {_cells(report.length_matched)}",
    ]
    out += [f"{(k + ' vs all benign')[:60]:<60} {_cells(v)}" for k, v in report.length_matched_by_family.items()]
    for h in report.rules_holdout:
        out += [
            f"-- rules alone, held out: reject threshold {h.threshold} set on {'+'.join(h.train)}",
            f"{('train: ' + '+'.join(h.train))[:60]:<60} {_cells(h.train_rates)}",
            f"{('test: ' + '+'.join(h.test))[:60]:<60} {_cells(h.test_rates)}",
        ]
    if report.false_positives:
        out += ["", "benign prompts the served filter rejected or altered:"]
        out += [
            f"  [{fp['action']} {fp['score']}] {fp['source']}: {', '.join(fp['reasons'])} {fp['text'][:60]!r}"
            for fp in report.false_positives
        ]
    return "\n".join(out)


def _rates(r: Rates) -> dict[str, Any]:
    return {**asdict(r), "catch_rate": r.catch_rate, "false_positive_rate": r.false_positive_rate}


def _stage_json(s: StageRates) -> dict[str, Any]:
    return {
        "overall": _rates(s.overall),
        "by_family": {k: _rates(v) for k, v in s.by_family.items()},
        "by_source": {k: _rates(v) for k, v in s.by_source.items()},
    }


def to_json(report: EvalReport) -> dict[str, Any]:
    """The report as JSON: ``overall``, ``by_family`` and ``by_source`` are the served filter's;
    ``stages`` has the same three for the served filter and for each stage alone."""
    served = _stage_json(report.served)
    return {
        "path": report.path,
        "mode": report.mode,
        "reject_threshold": report.reject_threshold,
        "classifier": report.classifier,
        **served,
        "stages": {name: _stage_json(s) for name, s in report.stages.items()},
        "length_matched": _rates(report.length_matched),
        "length_matched_by_family": {k: _rates(v) for k, v in report.length_matched_by_family.items()},
        "rules_holdout": [
            {
                "train_families": h.train,
                "test_families": h.test,
                "threshold": h.threshold,
                "train": _rates(h.train_rates),
                "test": _rates(h.test_rates),
            }
            for h in report.rules_holdout
        ],
        "false_positives": report.false_positives,
        "recorded": report.recorded,
    }
