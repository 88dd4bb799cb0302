"""`arena filter-eval`'s tables recorded at training.

The held-out figures need many trainings, so `arena filter-train` records them in the
artifact's metadata (lab/filter/heldout.py): leave-one-source-out per family and
mean, attack families held out, in-distribution k-fold, the dev file, and the dev split
in distribution (k-fold over the dev file, classifier alone and whole filter). The
figures measured now, on the file given, are evaluate.py's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["recorded_tables"]


def _rate(x: float | None) -> str:
    return "      -" if x is None else f"{100 * x:6.2f}%"


def _recorded(name: str, t: dict[str, Any]) -> list[str]:
    out = [
        f"-- {name}: threshold {t['threshold']:.4f}; mean catch over attack families {_rate(t['mean_catch'])},"
        f" pooled {_rate(t['pooled_catch'])}, benign rejected {_rate(t['fp'])}",
        f"{'family':<62} {'attacks':>7} {'caught':>7} {'benign':>7} {'FP':>7}",
    ]
    for fam, v in t["families"].items():
        out.append(f"{fam[:62]:<62} {v['attacks']:7d} {_rate(v['caught'])} {v['benign']:7d} {_rate(v['fp'])}")
    nested = t.get("nested_benign_fp")
    if nested:
        out.append(
            f"benign families at a threshold set without them (mean {_rate(nested['mean'])}): "
            + ", ".join(f"{fam.split('/')[-1]} {_rate(v).strip()}" for fam, v in nested["families"].items())
        )
    return out


def _dev_split(split: dict[str, Any]) -> list[str]:
    clf, flt = split["classifier"], split["filter"]
    out = [
        "-- dev split in distribution (5-fold over the dev file by family and label; each fold's"
        " model trained on the train file and the other dev folds; thresholds flag at most 0.3% of the held-out"
        " benign dev rows, pooled)",
        f"classifier alone: threshold {clf['threshold']:.4f}, mean catch {_rate(clf['mean_catch'])},"
        f" pooled {_rate(clf['pooled_catch'])}, benign flagged {_rate(clf['fp'])}",
        f"whole filter (rules, then classifier): classifier threshold {flt['threshold']:.4f},"
        f" mean catch {_rate(flt['mean_catch'])}, pooled {_rate(flt['pooled_catch'])},"
        f" benign rejected or altered {_rate(flt['fp'])}",
        f"{'family':<62} {'attacks':>7} {'clf':>7} {'filter':>7} {'benign':>7} {'clf FP':>7} {'flt FP':>7}",
    ]
    for fam, c in clf["families"].items():
        f = flt["families"][fam]
        out.append(
            f"{fam[:62]:<62} {c['attacks']:7d} {_rate(c['caught'])} {_rate(f['caught'])}"
            f" {c['benign']:7d} {_rate(c['fp'])} {_rate(f['fp'])}"
        )
    return out


def recorded_tables(recorded: dict[str, Any]) -> str:
    """The recorded section of the filter-eval printout: each stage's training report."""
    out: list[str] = []
    for stage, entry in recorded.items():
        out += _stage_tables(stage, entry["version"], entry.get("report", {}))
    return "\n".join(out)


def _stage_tables(stage: str, version: str, report: dict[str, Any]) -> list[str]:
    out = [f"== recorded at training: {stage} {version}"]
    if report.get("dev_in_training"):
        out.append(
            "note: this artifact trained on the dev file too: measured on that file, the figures above are in"
            " sample; the dev split table (last) is the held-out figure"
        )
    titles = {
        "loso": "leave-one-source-out, every family (threshold on held-out benign sources)",
        "loso_attack": "attack families held out, benign always trained on (threshold on a held-out benign fold)",
        "in_distribution": "in-distribution, stratified 5-fold",
        "dev": "dev file, {} at the LOSO threshold (the shipped one)",
        "dev_at_attack_threshold": "dev file, {} at the attack-held-out threshold",
    }
    scored_by = report.get("dev_scored_by", "final model")
    for key, title in titles.items():
        if key in report:
            out += ["", *_recorded(title.format(scored_by), report[key])]
    if "dev_split" in report:
        out += ["", *_dev_split(report["dev_split"])]
    if not report.get("loso"):
        out += ["", f"(no held-out figures recorded: threshold from {report.get('threshold_from', 'unknown')})"]
    return out
