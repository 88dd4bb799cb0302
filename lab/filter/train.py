"""`arena filter-train`: fit the classifier stage and measure it honestly.

Model: one linear score over views of a prompt, each fitted as its own logistic
regression with sample weights that give each class half the weight and each
source family the same share of its class (heldout.family_weights), except that
the dev file's families, trained on by default (``--train-on-dev``), weigh
``DEV_WEIGHT`` times as much (``--dev-weight``):

* ``chars``: hashed character 3-5-grams (features.py; liblinear dual, C=10), the
  surface of the attacks seen in training, robust to obfuscation;
* ``cues``: the hand-written cues of cues.py (lbfgs on standardized cues, C=1):
  harm and "instruction aimed at the model" vocabulary, phrases and shape;
* ``words`` (``--words``, off by default): hashed words and word bigrams,
  normalized on their own (same fit as chars). About 1 point more held out, but
  it costs a third more time per prompt than the two others together.

Beside the linear score, a known-attack memory (memory.py; ``--memory-weight 0`` leaves it
out): bottom-k sketches of the training attacks' word 3-grams; ``memory.WEIGHT`` times
the largest share of one stored attack found in a prompt is added to the logit. Every
protocol below builds it from its own training rows only.

Each view's logit is centred and scaled by the median and spread of its scores on
the benign training prompts and weighted by ``VIEW_MIX``; the sum is folded into one
weight vector (the views' weights side by side) and one bias, so serving is one
dot product per view. Training is deterministic for a seed: features are hashes,
liblinear's coordinate order comes from ``random_state``, and lbfgs is deterministic.

Evaluation (lab/filter/heldout.py), written into the artifact's metadata
and printed by `arena filter-eval`, each at a threshold flagging at most 0.3% of
benign prompts the model did not train on:

* ``loso``: every source family held out in turn, benign families included; the
  shipped threshold comes from these held-out benign scores;
* ``loso_attack``: attack families held out, benign data always trained on (less
  one fold, scored for the threshold): "an attack family never seen";
* ``in_distribution``: stratified 5-fold;
* ``dev_split``: the dev file in distribution: 5-fold over the dev rows, the train
  file in every fold, threshold on the held-out arena-hard rows; the classifier
  alone and the whole filter (rules, then classifier);
* ``dev``: the dev file (JailbreakBench attacks, arena-hard benign) at the LOSO
  threshold and at the attack-held-out one, scored by the final model, or by the
  dev split's k-fold models when the final model trained on the dev file.

With the dev file in training, every protocol runs over the train and dev rows.

scikit-learn is needed here only; serving scores the saved weights with numpy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from consumers.filter.cues import CUE_NAMES, CUES_VERSION, cue_tokens, cue_vector
from consumers.filter.features import CHAR_ORDERS, FEATURES_VERSION, WORD_ORDERS, featurize, featurize_views
from consumers.filter.memory import WEIGHT as MEMORY_WEIGHT
from consumers.filter.memory import Memory, lines, shingles
from consumers.filter.policy import inspect_prompt
from lab.filter import heldout, protocols
from lab.filter.corpus import Row

__all__ = ["Data", "Trained", "data", "dev_rows", "fit", "fit_views", "matrix", "rules_flag", "train"]

FP_CAP = 0.003
BITS = 18
C = 10.0  # weak regularization: held-out catch rose from 1% (C=1) to 12% (C=10), see docs/filter.md
CUE_C = 1.0
# Weight of each view's benign-scaled logit in the sum. Chosen among a few values on the
# LOSO mean (so that figure is optimistic by the choice); docs/filter.md has the grid.
VIEW_MIX = {"chars": 1.0, "words": 1.0, "cues": 0.25}
TRAIN_FILE = Path(__file__).resolve().parents[3] / "shared/data/injection-train.jsonl"
DEV_FILE = TRAIN_FILE.with_name("injection-dev.jsonl")
TRAIN_ON_DEV = True  # the shipped artifact's recipe: is the dev file in its training rows?
# Each dev family weighs this many times a train family of its class, in every fit that has dev
# rows: the dev file is the deployment's own traffic (arena prompts, JailbreakBench attacks).
DEV_WEIGHT = 8.0  # chosen on the dev split among 1 to 32 (docs/filter.md): that figure is optimistic by the choice


def matrix(rows: Sequence[Row], bits: int, char_orders=CHAR_ORDERS, word_orders=WORD_ORDERS):
    """CSR matrix of binary, L2-normalized hashed n-grams, one row per prompt."""
    import scipy.sparse as sp  # noqa: PLC0415

    index = [featurize(r.text, bits, char_orders, word_orders).index for r in rows]
    indptr = np.cumsum([0] + [len(i) for i in index])
    data = np.concatenate([np.full(len(i), 1.0 / np.sqrt(max(len(i), 1))) for i in index])
    return sp.csr_matrix((data, np.concatenate(index), indptr), shape=(len(rows), 1 << bits))


def _csr(index: list[np.ndarray], width: int):
    import scipy.sparse as sp  # noqa: PLC0415

    indptr = np.cumsum([0] + [len(i) for i in index])
    data = np.concatenate([np.full(len(i), 1.0 / np.sqrt(max(len(i), 1))) for i in index])
    return sp.csr_matrix((data, np.concatenate(index), indptr), shape=(len(index), width))


def view_names(word_orders: tuple[int, ...], cues: bool) -> list[str]:
    """The views a model has, in the order of its weight vector."""
    return ["chars", *(["words"] if word_orders else []), *(["cues"] if cues else [])]


def views(rows: Sequence[Row], bits: int, char_orders=CHAR_ORDERS, word_orders=WORD_ORDERS, cues: bool = True):
    """One matrix of every view side by side: character n-grams, word n-grams (when
    ``word_orders``), each L2-normalized on its own, then the cues (when ``cues``)."""
    return data(rows, bits, char_orders, word_orders, cues).views


@dataclass(frozen=True)
class Data:
    """Training rows as the fits see them: the views (a CSR matrix), each row's word 3-gram
    shingles and its non-empty lines (for the memory). Indexed by rows like the matrix."""

    views: Any
    shingles: tuple[np.ndarray, ...]
    lines: np.ndarray

    def __getitem__(self, rows) -> Data:
        idx = np.flatnonzero(rows) if np.asarray(rows).dtype == bool else np.asarray(rows)
        return Data(self.views[idx], tuple(self.shingles[i] for i in idx), self.lines[idx])

    def __len__(self) -> int:
        return len(self.shingles)

    @staticmethod
    def stack(a: Data, b: Data) -> Data:
        import scipy.sparse as sp  # noqa: PLC0415

        return Data(sp.vstack([a.views, b.views], format="csr"), a.shingles + b.shingles, np.r_[a.lines, b.lines])


def data(rows: Sequence[Row], bits: int, char_orders=CHAR_ORDERS, word_orders=WORD_ORDERS, cues: bool = True) -> Data:
    """The views of :func:`views` and the rows' shingles, from one featurizing pass."""
    import scipy.sparse as sp  # noqa: PLC0415

    pairs = [featurize_views(r.text, bits, char_orders, word_orders) for r in rows]
    tokens = [cue_tokens(c.text) for c, _ in pairs]
    blocks = [_csr([c.index for c, _ in pairs], 1 << bits)]
    if word_orders:
        blocks.append(_csr([w.index for _, w in pairs], 1 << bits))
    if cues:
        dense = np.array(
            [cue_vector(c.text, r.text, t) for (c, _), r, t in zip(pairs, rows, tokens, strict=True)]
        ).reshape(len(rows), len(CUE_NAMES))
        blocks.append(sp.csr_matrix(dense))
    return Data(
        sp.hstack(blocks, format="csr"), tuple(shingles(t) for t in tokens), np.array([lines(r.text) for r in rows])
    )


def build_memory(x: Data, y: np.ndarray, weight: float) -> Memory:
    """The known-attack memory of the attack rows of ``x`` (a request, not a document: see
    memory.py), less what its benign rows share."""
    attacks = [s for s, a in zip(x.shingles, y, strict=True) if a]
    benign = [s for s, a in zip(x.shingles, y, strict=True) if not a]
    return Memory.build(attacks, benign, weight=weight, attack_lines=x.lines[y].tolist())


def _memory_logits(memory: Memory | None, x: Data) -> np.ndarray:
    if memory is None:
        return np.zeros(len(x))
    return np.array([memory.logit(s) for s in x.shingles])


def fit(x, y: np.ndarray, c: float, seed: int, sample_weight: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Weights and bias of a logistic regression; the same inputs and seed give the same weights."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415

    # dual liblinear: fast when features far outnumber prompts, as here
    model = LogisticRegression(C=c, solver="liblinear", dual=True, max_iter=1000, random_state=seed)
    model.fit(x, y, sample_weight=sample_weight)
    return model.coef_[0].astype(np.float32), float(model.intercept_[0])


def _fit_cues(cues: np.ndarray, y: np.ndarray, sample_weight: np.ndarray) -> tuple[np.ndarray, float]:
    """Logistic regression on standardized cues, returned in raw cue units (weights, bias)."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415

    mean, scale = cues.mean(axis=0), cues.std(axis=0)
    scale[scale == 0] = 1.0
    model = LogisticRegression(C=CUE_C, max_iter=5000).fit((cues - mean) / scale, y, sample_weight=sample_weight)
    coef = model.coef_[0] / scale
    return coef, float(model.intercept_[0] - coef @ mean)


def _benign_scale(logits: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    benign = logits[~y]
    return float(np.median(benign)), float(benign.std()) or 1.0


def fit_views(
    x, y: np.ndarray, c: float, seed: int, sample_weight: np.ndarray, bits: int, names: Sequence[str]
) -> tuple[np.ndarray, float]:
    """One weight vector (the views of ``names``, in order) and a bias; see the module docstring."""
    n = 1 << bits
    weights, bias, start = [], 0.0, 0
    for name in names:
        width = len(CUE_NAMES) if name == "cues" else n
        block = x[:, start : start + width]
        start += width
        if name == "cues":
            dense = block.toarray()
            w, b = _fit_cues(dense, y, sample_weight)
            logits = dense @ w + b
        else:
            w, b = fit(block, y, c, seed, sample_weight)
            logits = _logits(block, w, b)
        if len(names) == 1:
            return w, b
        mid, spread = _benign_scale(logits, y)
        weights.append(VIEW_MIX[name] * w / spread)
        bias += VIEW_MIX[name] * (b - mid) / spread
    return np.concatenate(weights).astype(np.float32), bias


def _logits(x, w: np.ndarray, b: float) -> np.ndarray:
    return np.asarray(x @ w.astype(np.float64)).ravel() + b


def _scorer(w: np.ndarray, b: float, memory: Memory | None) -> Callable[[Data], np.ndarray]:
    return lambda xs: _logits(xs.views, w, b) + _memory_logits(memory, xs)


def _fitter(c: float, seed: int, bits: int, names: Sequence[str], memory_weight: float) -> heldout.Fit:
    def fit_rows(x: Data, y, sample_weight):
        w, b = fit_views(x.views, y, c, seed, sample_weight, bits, names)
        return _scorer(w, b, build_memory(x, y, memory_weight) if memory_weight else None)

    return fit_rows


def _prob(logit: float) -> float:
    return float(1.0 / (1.0 + np.exp(-logit)))


def rules_flag(rows: Sequence[Row]) -> np.ndarray:
    """Whether the rules alone (default config, no classifier) reject or alter each row."""
    return np.array([inspect_prompt(r.text).action != "pass" for r in rows], dtype=bool)


def training_set(
    rows: Sequence[Row], dev: Sequence[Row], train_on_dev: bool, dev_weight: float
) -> tuple[list[Row], np.ndarray, np.ndarray, dict[str, float] | None]:
    """The rows every stage fits (the train file, then the dev file when trained on), their labels,
    families, and the families boosted in the sample weights (the dev file's)."""
    fitted = [*rows, *dev] if train_on_dev else list(rows)
    boost = {r.family: dev_weight for r in dev} if dev and dev_weight != 1.0 else None
    return fitted, np.array([r.attack for r in fitted]), np.array([r.family for r in fitted]), boost


def dev_rows(dev: Sequence[Row], x, in_training: bool, rules: np.ndarray | None = None) -> protocols.DevRows:
    """The dev file for the protocols (``x``: its rows' features in the stage's form)."""
    return protocols.DevRows(
        x,
        np.array([r.attack for r in dev]),
        np.array([r.family for r in dev]),
        rules if rules is not None else rules_flag(dev),
        in_training,
    )


class Trained(NamedTuple):
    """What :func:`train` fits: the linear weights and bias, the artifact's metadata, the memory,
    and the held-out scores under every protocol (None without ``evaluate_heldout``)."""

    weights: np.ndarray
    bias: float
    meta: dict[str, Any]
    memory: Memory | None
    heldout: protocols.HeldOut | None = None
    reference: np.ndarray | None = None  # benign logits, held out (LOSO) or in sample: the calibration


def train(
    rows: Sequence[Row],
    *,
    bits: int = BITS,
    c: float = C,
    seed: int = 0,
    balance: str = "family",
    char_orders: tuple[int, ...] = CHAR_ORDERS,
    word_orders: tuple[int, ...] = (),
    cues: bool = True,
    evaluate_heldout: bool = True,
    dev: Sequence[Row] = (),
    train_on_dev: bool = TRAIN_ON_DEV,
    dev_weight: float = DEV_WEIGHT,
    memory_weight: float = MEMORY_WEIGHT,
    fp_cap: float = FP_CAP,
    rules: np.ndarray | None = None,
    log: Callable[[str], None] = print,
) -> Trained:
    """Fit on ``rows`` (and ``dev`` with ``train_on_dev``, each dev family weighing ``dev_weight``
    train families); with ``evaluate_heldout``, also the held-out figures. ``memory_weight`` 0:
    no known-attack memory."""
    fitted, y, fam, boost = training_set(rows, dev, train_on_dev, dev_weight)
    names = view_names(word_orders, cues)
    x_all = data([*rows, *dev], bits, char_orders, word_orders, cues)
    x = x_all[np.arange(len(fitted))]
    w, b = fit_views(x.views, y, c, seed, heldout.family_weights(y, fam, balance, boost), bits, names)
    memory = build_memory(x, y, memory_weight) if memory_weight else None
    final = _scorer(w, b, memory)
    report: dict[str, Any] = {
        "fp_cap": fp_cap,
        "rows": len(fitted),
        "attacks": int(y.sum()),
        "balance": balance,
        "dev_in_training": bool(train_on_dev and dev),
        "dev_weight": dev_weight,
    }
    held = None
    if evaluate_heldout:
        dev_file = dev_rows(dev, x_all[np.arange(len(rows), len(x_all))], train_on_dev, rules) if dev else None
        setup = protocols.Setup(y, fam, balance, seed, boost, dev_file, fp_cap, log)
        held, tables, t = protocols.evaluate(x, _fitter(c, seed, bits, names, memory_weight), setup, final, Data.stack)
        report.update(tables)
    else:  # quick runs (tests, small subsets): the in-sample threshold, marked as such
        t = heldout.threshold_at(final(x)[~y], fp_cap)
    report["threshold_from"] = "loso" if evaluate_heldout else "in-sample"
    stored = memory.sketches.tobytes() + memory.sizes.tobytes() if memory is not None else b""
    digest = hashlib.sha256(w.tobytes() + np.float32(b).tobytes() + stored).hexdigest()[:12]
    model: dict[str, Any] = {
        "family": "one LR per view (n-grams: liblinear dual; cues: lbfgs, standardized), benign-scaled and summed",
        "C": c,
        "seed": seed,
        "mix": {name: VIEW_MIX[name] for name in names},
    }
    if cues:
        model["cue_C"] = CUE_C
    meta: dict[str, Any] = {
        "version": f"{'-'.join([*names, *(['memory'] if memory is not None else [])])}-lr-{digest}",
        "views": names,
        "features": FEATURES_VERSION,
        "bits": bits,
        "char_orders": list(char_orders),
        "word_orders": list(word_orders),
        "threshold": _prob(t),
        "model": model,
        "report": report,
    }
    if cues:
        meta["cues"] = {"version": CUES_VERSION, "names": list(CUE_NAMES)}
    if memory is not None:
        meta["memory"] = memory.meta()
    reference = held.loso[~y] if held is not None else final(x)[~y]
    return Trained(w, b, meta, memory, held, reference)
