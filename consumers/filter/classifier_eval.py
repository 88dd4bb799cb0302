"""`arena filter-eval`'s classifier tables.

Two kinds of figures:

* measured now, on the file given: the classifier alone and the whole filter
  (rules, then classifier, mode block) per source family, at the artifact's
  threshold;
* recorded at training (they need many trainings): leave-one-source-out per
  family and mean, attack families held out, in-distribution k-fold, the dev
  file, and the dev split in distribution (k-fold over the dev file, classifier
  alone and whole filter), from the artifact's metadata (consumers/filter/heldout.py).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from consumers.filter.classifier import Classifier, LinearClassifier
from consumers.filter.config import FilterConfig
from consumers.filter.corpus import load_rows
from consumers.filter.policy import inspect_prompt

__all__ = ["classifier_tables", "measure"]


def measure(path: str, classifier: Classifier, config: FilterConfig | None = None) -> dict[str, dict[str, Any]]:
    """Per family: attacks/benign, caught/flagged by the classifier alone and by the whole filter."""
    config = config or FilterConfig(mode="block")
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in load_rows(path):
        v = inspect_prompt(row.text, config, classifier)
        a = acc[row.family]
        kind = "attacks" if row.attack else "benign"
        a[kind] += 1
        a[f"{kind}_clf"] += bool(v.classifier and v.classifier.flagged)
        # whole filter: a benign prompt counts when rejected or altered, an attack when rejected or sanitized
        a[f"{kind}_all"] += v.action != "pass"
    return {fam: dict(v) for fam, v in sorted(acc.items())}


def _pct(num: float, den: float) -> str:
    return f"{100 * num / den:6.1f}%" if den else "      -"


def _rate(x: float | None) -> str:
    return "      -" if x is None else f"{100 * x:6.2f}%"


def _measured(path: str, table: dict[str, dict[str, Any]]) -> list[str]:
    out = [
        f"-- classifier on {path} (alone, and the whole filter: rules then classifier, mode block)",
        f"{'family':<62} {'attacks':>7} {'clf':>7} {'filter':>7} {'benign':>7} {'clf FP':>7} {'flt FP':>7}",
    ]
    tot: dict[str, float] = defaultdict(float)
    for fam, a in table.items():
        for k, v in a.items():
            tot[k] += v
        out.append(_measured_line(fam, a))
    out.append(_measured_line("all", tot))
    return out


def _measured_line(name: str, a: dict[str, float]) -> str:
    att, ben = a.get("attacks", 0), a.get("benign", 0)
    return (
        f"{name[:62]:<62} {att:7.0f} {_pct(a.get('attacks_clf', 0), att)} {_pct(a.get('attacks_all', 0), att)}"
        f" {ben:7.0f} {_pct(a.get('benign_clf', 0), ben)} {_pct(a.get('benign_all', 0), ben)}"
    )


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
        "-- recorded at training: dev split in distribution (5-fold over the dev file by family and label; each fold's"
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


def classifier_tables(path: str, classifier: Classifier, config: FilterConfig | None = None) -> str:
    """The classifier's section of the filter-eval printout."""
    out = [f"classifier {classifier.version}, threshold {classifier.threshold:.4f}", ""]
    report = classifier.meta.get("report", {}) if isinstance(classifier, LinearClassifier) else {}
    memory = classifier.memory if isinstance(classifier, LinearClassifier) else None
    if memory is not None:
        out.insert(
            1,
            f"known-attack memory: {len(memory)} training attacks, logit + {memory.weight:g} x containment"
            " (it recognizes attacks seen in training, and adds nothing for a family never seen)",
        )
    if report.get("dev_in_training"):
        out.append(
            "note: this artifact trained on the dev file too: measured on that file, the figures below are in"
            " sample; the dev split table (last) is the held-out figure"
        )
    out += _measured(path, measure(path, classifier, config))
    titles = {
        "loso": "recorded at training: leave-one-source-out, every family (threshold on held-out benign sources)",
        "loso_attack": (
            "recorded at training: attack families held out, benign always trained on"
            " (threshold on a held-out benign fold)"
        ),
        "in_distribution": "recorded at training: in-distribution, stratified 5-fold",
        "dev": "recorded at training: dev file, {} at the LOSO threshold (the shipped one)",
        "dev_at_attack_threshold": "recorded at training: dev file, {} at the attack-held-out threshold",
    }
    scored_by = report.get("dev_scored_by", "final model")
    for key, title in titles.items():
        if key in report:
            out += ["", *_recorded(title.format(scored_by), report[key])]
    if "dev_split" in report:
        out += ["", *_dev_split(report["dev_split"])]
    if not report.get("loso"):
        out += ["", f"(no held-out figures recorded: threshold from {report.get('threshold_from', 'unknown')})"]
    return "\n".join(out)
