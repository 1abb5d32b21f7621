"""Linear probes on frozen features: which view (layer × pooling) carries the label?

For each view: standardised features → logistic regression (classification) or ridge
(numeric labels), stratified k-fold with a fixed seed; mean and spread across folds, next
to the majority-class (or mean-value) baseline. `scalar_mix` learns ELMo weights

    x = γ · Σ_k softmax(s)_k x_k        (x_k = the pooled features of layer k)

jointly with a linear head. For poolings that are linear in the token states (mean, cls,
attention, last) this equals pooling the mixed hidden states, so the learned (s, γ) can be
pasted into a job as a `scalar_mix` view.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..errors import InputError, OptionError
from ..stores.opened import StoreData as Store

LINEAR_POOLINGS = ("mean", "cls", "attention", "last")
log = logging.getLogger(__name__)
FLAT_GAIN = 0.01  # learning curve: less gain than this per doubling of labels reads "flat"
CURVE_START = 50  # learning curve: first size; then doubling up to the whole training fold
MIN_PER_CLASS = 3  # a subsample keeps this many rows of every class (inner 3-fold CV)


class ProbeError(InputError):
    """The labels cannot be probed (missing, constant, too few per class, unmatched ids):
    an input problem, exit 3."""


@dataclass
class ProbeResult:
    view: str
    layer: int | None  # single-layer views: absolute hidden-state index
    pooling: str
    metrics: dict[str, float]  # e.g. accuracy, accuracy_std, macro_f1, macro_f1_std
    # each outer fold's regularisation: logistic C chosen by the inner CV (the inverse of
    # the L2 strength: smaller C, stronger penalty), or ridge alpha (the L2 strength)
    regularisation: list[float] = field(default_factory=list)


@dataclass
class MixResult:
    pooling: str
    weights: list[float]  # s: raw scalar-mix parameters, one per layer 0..L
    gamma: float
    metrics: dict[str, float]

    @property
    def softmax(self) -> list[float]:
        s = np.asarray(self.weights)
        e = np.exp(s - s.max())
        return (e / e.sum()).tolist()

    def view_block(self, name: str = "probe_mix") -> str:
        weights = ", ".join(f"{w:.4f}" for w in self.weights)
        return (f"{name}: {{layers: all, combine: scalar_mix, weights: [{weights}], "
                f"gamma: {self.gamma:.4f}, pooling: {self.pooling}}}")


@dataclass
class LearningCurve:
    """Probe score against labelled rows for one view: at each size, stratified subsamples
    of every training fold (one per fold and seed), scored on that fold's full test part."""

    view: str
    sizes: list[int]
    mean: list[float]
    std: list[float]  # over folds × seeds
    repeats: int  # seeds per fold (1 at the last size, where the subsample is the fold)
    gain_per_doubling: float  # over the last doubling: see `reading`
    flat: bool

    def reading(self, key: str) -> str:
        """Flat when the score gains less than FLAT_GAIN per doubling of labelled rows between
        the largest size and the largest one at most half of it."""
        if len(self.sizes) < 2:
            return "one size only: no trend to read"
        gain = f"{self.gain_per_doubling:+.3f} {key} per doubling of labelled rows at the end"
        if self.flat:
            return (f"flat ({gain}, under {FLAT_GAIN}): the frozen features are enough; "
                    "more labels are unlikely to help this probe")
        return (f"still rising ({gain}): more labels, or fine-tuning, may pay")


@dataclass
class ProbeReport:
    task: str  # classification | regression
    label: str
    n_rows: int
    n_folds: int
    seed: int
    baseline: dict[str, float]
    results: list[ProbeResult]
    mix: MixResult | None = None
    classes: dict[str, int] = field(default_factory=dict)
    curves: list[LearningCurve] = field(default_factory=list)
    # rows left out and why: no vector (empty or failed text), no label
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def score_key(self) -> str:
        return "accuracy" if self.task == "classification" else "r2"

    def best(self) -> ProbeResult:
        return max(self.results, key=lambda r: r.metrics[self.score_key])

    def recommendation(self) -> str:
        best = self.best()
        key = self.score_key
        runner_up = sorted(self.results, key=lambda r: -r.metrics[key])[1:2]
        margin = ""
        if runner_up:
            gap = best.metrics[key] - runner_up[0].metrics[key]
            within = gap < best.metrics[f"{key}_std"]
            margin = (f", {gap:+.3f} over {runner_up[0].view}"
                      + (" (within one fold standard deviation)" if within else ""))
        return (f"Use view {best.view!r} ({best.pooling}"
                + (f", layer {best.layer}" if best.layer is not None else "")
                + f"): {key} {best.metrics[key]:.3f} ± {best.metrics[key + '_std']:.3f} "
                f"vs baseline {self.baseline[key]:.3f}{margin}.")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["recommendation"] = self.recommendation()
        if self.mix is not None:
            out["mix"]["softmax"] = self.mix.softmax
            out["mix"]["view_block"] = self.mix.view_block()
        for curve, raw in zip(self.curves, out["curves"], strict=True):
            raw["reading"] = curve.reading(self.score_key)
        return out


def load_labels(store: Store, label: str, labels_file: str | None = None,
                id_column: str | None = None) -> pd.Series:
    """The label per store row (index = row), from a carried column or a joined file."""
    if labels_file is None:
        if label not in store.docs:
            carried = store.provenance.job.input.carry_columns
            raise ProbeError(f"--label: {label!r} is not a carried column of the store "
                             f"(carried: {', '.join(carried) or 'none'}); or pass --labels FILE")
        labels = pd.Series(np.asarray(store.docs[label].values))
        if labels.isna().all():
            raise ProbeError(f"--label: carried column {label!r} is empty (all "
                             f"{len(labels)} values are null)")
        return labels
    try:
        table = pd.read_parquet(labels_file)
    except (OSError, ValueError) as exc:  # missing, a folder, not Parquet (ArrowInvalid)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ProbeError(f"--labels: cannot read {labels_file} as Parquet ({first})") from None
    key = id_column or "id"
    for col in (key, label):
        if col not in table.columns:
            raise ProbeError(f"{labels_file}: column {col!r} not found "
                             f"(columns: {', '.join(map(str, table.columns))})")
    if table[label].isna().all():  # else every id "matches" nothing, which misleads
        raise ProbeError(f"{labels_file}: label column {label!r} is empty (all {len(table)} "
                         "values are null)")
    ids = pd.Series(np.asarray(store.docs["id"].values))
    mapping = table.drop_duplicates(key).set_index(key)[label]
    joined = ids.map(mapping)
    if joined.isna().all():
        raise ProbeError(f"{labels_file}: no {key!r} matches the store's ids "
                         f"(store ids look like {plain(ids.iloc[0])!r}, file ids like "
                         f"{plain(table[key].iloc[0])!r})")
    return joined


def plain(value: Any) -> Any:
    """A NumPy scalar as the Python value it holds: messages show 'x' and 3, not
    np.str_('x') and np.int64(3)."""
    return value.item() if isinstance(value, np.generic) else value


def run_probe(store: Store, labels: pd.Series, views: Sequence[str] | None = None,
              folds: int = 5, seed: int = 0, scalar_mix: str | None = None,
              learning_curve: bool = False, curve_sizes: Sequence[int] | None = None,
              curve_repeats: int = 3, on_view: Callable[[str], None] | None = None
              ) -> ProbeReport:
    """Cross-validated linear probes of each view; `on_view(message)` after each view and
    each fold of the scalar mix (its fits take minutes on real stores)."""
    if folds < 2:
        raise OptionError(f"--folds: {folds}; cross-validation needs at least 2 folds")
    # a row an edit superseded holds an old text: left out, as its id's current row counts
    current = ~store.superseded()
    has_vector = np.asarray(store.docs["status"].values) == "ok"
    has_label = labels.notna().to_numpy()
    ok = has_vector & has_label & current
    dropped = {"no_vector": int((~has_vector & current).sum()),
               "no_label": int((has_vector & ~has_label & current).sum()),
               "superseded": int((~current).sum())}
    if not ok.any():
        raise ProbeError(f"no row has both a document vector and a label ({dropped['no_vector']}"
                         f" without a vector, {dropped['no_label']} without a label): nothing "
                         "to probe")
    y_raw = labels.to_numpy()[ok]
    task = "regression" if _is_numeric(y_raw) else "classification"
    y, classes = _encode_labels(y_raw, task, folds)
    folds = _folds_for(y, task, folds)
    names = list(views or store.views)
    if not names:
        raise ProbeError(f"{store.path}: no document vectors to probe (token views only: "
                         f"{', '.join(store.token_views)}); add a pooled view to the job")
    if learning_curve:  # refuse bad sizes before any fitting
        _check_curve_options(curve_sizes, curve_repeats, _min_curve_size(y, task))
    results, curves = [], []
    started = time.perf_counter()
    for i, name in enumerate(names, 1):
        x = store.vectors(name)[ok].astype(np.float64)
        layer, pooling = _view_layer_pooling(store, name)
        metrics, strengths = _cross_validate(x, y, task, folds, seed)
        results.append(ProbeResult(name, layer, pooling, metrics, strengths))
        if learning_curve:
            curves.append(fit_learning_curve(name, x, y, task, folds, seed, curve_sizes,
                                             curve_repeats))
        if on_view:
            key = "accuracy" if task == "classification" else "r2"
            on_view(f"probe: view {i}/{len(names)} {name}: {key} {metrics[key]:.3f} "
                    f"({time.perf_counter() - started:.0f}s)")
    report = ProbeReport(task, str(labels.name or "label"), int(ok.sum()), folds, seed,
                         _baseline(y, task), results, classes=classes, curves=curves,
                         dropped=dropped)
    if scalar_mix:
        report.mix = learn_scalar_mix(store, ok, y, task, scalar_mix, folds, seed, on_view)
    return report


def _is_numeric(y: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(y).dtype, np.number) and len(np.unique(y)) > 10


def _encode_labels(y: np.ndarray, task: str, folds: int) -> tuple[np.ndarray, dict[str, int]]:
    if task == "regression":
        y = y.astype(np.float64)
        if np.ptp(y) == 0:
            raise ProbeError("label is constant: nothing to probe")
        return y, {}
    values, codes, counts = np.unique(y.astype(str), return_inverse=True, return_counts=True)
    if len(values) < 2:
        raise ProbeError(f"label is constant ({plain(values[0])!r} for every row): "
                         "nothing to probe")
    if counts.min() < 2:
        rare = values[counts.argmin()]
        raise ProbeError(f"label class {plain(rare)!r} has {counts.min()} example; every "
                         "class needs at least 2 (and ideally one per fold)")
    return codes, {str(v): int(c) for v, c in zip(values, counts, strict=True)}


def _view_layer_pooling(store: Store, name: str) -> tuple[int | None, str]:
    prov = store.provenance
    post = prov.post.get(name)
    spec = prov.view_spec(prov.source_view(name))
    assert spec is not None  # a store's post views always derive from an extracted view
    if post is not None:  # a post-processed view: not a plain layer x pooling cell
        return None, f"{spec.pooling}+{post.method}"
    n_layers = prov.model.n_layers
    if spec.pooling == "pooler":
        return n_layers, "pooler"
    if isinstance(spec.layers, tuple) and len(spec.layers) == 1:
        i = spec.layers[0]
        return (i + n_layers + 1 if i < 0 else i), spec.pooling
    return None, spec.pooling


def _folds_for(y: np.ndarray, task: str, folds: int) -> int:
    """The folds used: never more than the rows, nor (stratified) than the rarest class
    has members; fewer than asked is said on stderr and in the report's n_folds."""
    if folds > len(y):
        raise ProbeError(f"--folds: {folds} folds for {len(y)} labelled rows")
    if task == "classification":
        rarest = int(np.bincount(y).min())
        if rarest < folds:
            log.warning("probe: the rarest label class has %d rows, so %d-fold cross-validation "
                        "is used instead of %d", rarest, rarest, folds)
            return rarest
    return folds


def _splits(y: np.ndarray, task: str, folds: int, seed: int) -> list[tuple[np.ndarray,
                                                                          np.ndarray]]:
    from sklearn.model_selection import KFold, StratifiedKFold

    if task == "classification":
        splitter: Any = StratifiedKFold(folds, shuffle=True, random_state=seed)
    else:
        splitter = KFold(folds, shuffle=True, random_state=seed)
    return list(splitter.split(np.zeros(len(y)), y))


def _cross_validate(x: np.ndarray, y: np.ndarray, task: str, folds: int, seed: int
                    ) -> tuple[dict[str, float], list[float]]:
    """Mean ± std of each metric over the outer folds, and each fold's regularisation."""
    from scipy.stats import spearmanr
    from sklearn.metrics import accuracy_score, f1_score, r2_score

    scores: dict[str, list[float]] = {}
    strengths = []
    for train, test in _splits(y, task, folds, seed):
        pred, strength = _fit_predict(x[train], y[train], x[test], task, seed)
        strengths.append(strength)
        if task == "classification":
            fold = {"accuracy": accuracy_score(y[test], pred),
                    "macro_f1": f1_score(y[test], pred, average="macro")}
        else:
            fold = {"r2": r2_score(y[test], pred),
                    "spearman": float(spearmanr(y[test], pred).statistic)}
        for k, v in fold.items():
            scores.setdefault(k, []).append(float(v))
    return _summarise(scores), strengths


def _fit_predict(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, task: str,
                 seed: int) -> tuple[np.ndarray, float]:
    """The probe: standardised features, then logistic (inner-CV L2) or ridge regression.
    Returns the predictions and the regularisation used (the C chosen, or ridge's alpha)."""
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if task == "classification":
        warnings.filterwarnings("ignore", category=FutureWarning)  # sklearn API churn
        model = make_pipeline(StandardScaler(), _logistic(seed, y_train))
    else:
        model = make_pipeline(StandardScaler(), Ridge(alpha=1.0))
    model.fit(x_train, y_train)
    pred: np.ndarray = model.predict(x_test)
    head = model[-1]
    return pred, float(head.C_[0] if hasattr(head, "C_") else head.alpha)


def _score(y_true: np.ndarray, pred: np.ndarray, task: str) -> float:
    from sklearn.metrics import accuracy_score, r2_score

    return float(accuracy_score(y_true, pred) if task == "classification"
                 else r2_score(y_true, pred))


def _logistic(seed: int, y: np.ndarray) -> Any:
    """Logistic regression whose L2 strength is chosen by an inner 3-fold CV on the
    training folds only: a few hundred rows against hundreds of features overfit at C=1.
    The inner CV has fewer folds only where no class of `y` has 3 rows (it cannot run)."""
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.model_selection import StratifiedKFold

    inner = min(3, int(np.bincount(y).max()))
    if inner < 2:
        raise ProbeError("too few labelled rows: a training fold needs 2 rows of some class "
                         "to choose the regularisation; use fewer --folds or more rows")
    return LogisticRegressionCV(Cs=[0.001, 0.01, 0.1, 1.0], max_iter=2000,
                                cv=StratifiedKFold(inner, shuffle=True, random_state=seed))


def _summarise(scores: dict[str, list[float]]) -> dict[str, float]:
    out = {}
    for k, values in scores.items():
        out[k] = float(np.mean(values))
        out[f"{k}_std"] = float(np.std(values))
    return out


def _baseline(y: np.ndarray, task: str) -> dict[str, float]:
    if task == "classification":
        majority = np.bincount(y).argmax()
        acc = float((y == majority).mean())
        # macro-F1 of always predicting the majority: F1 of that class / number of classes
        f1_major = 2 * acc / (1 + acc)
        return {"accuracy": acc, "accuracy_std": 0.0,
                "macro_f1": f1_major / len(np.unique(y)), "macro_f1_std": 0.0}
    return {"r2": 0.0, "r2_std": 0.0, "spearman": 0.0, "spearman_std": 0.0}


def single_layer_views(store: Store, names: Sequence[str] | None = None) -> list[str]:
    """The views that read exactly one hidden state (the layer x pooling grid)."""
    chosen = [n for n in (names or store.views) if _view_layer_pooling(store, n)[0] is not None]
    if not chosen:
        raise ProbeError("--layers: the store has no single-layer views; extract a sweep "
                         "(jobs/sweep.yaml) first")
    return chosen


# ---- learning curves -------------------------------------------------------------------

def _min_curve_size(y: np.ndarray, task: str) -> int:
    return MIN_PER_CLASS * len(np.unique(y)) if task == "classification" else 10


def _check_curve_options(sizes: Sequence[int] | None, repeats: int, minimum: int) -> None:
    small = [n for n in sizes or () if n < minimum]
    if small:
        raise ProbeError(f"--curve-sizes: {small[0]} rows is too few; the smallest size is "
                         f"{minimum} ({MIN_PER_CLASS} per class)")
    if repeats < 1:
        raise OptionError(f"--curve-repeats: {repeats} must be at least 1")


def curve_sizes(n_max: int, requested: Sequence[int] | None, minimum: int) -> list[int]:
    """50, 100, 200, ... below the smallest training fold, then that fold's size (all
    rows); or the requested sizes up to it, plus it."""
    if requested:
        sizes = sorted({n for n in requested if n < n_max})
    else:
        start = max(CURVE_START, minimum)
        sizes = [start * 2 ** k for k in range(32) if start * 2 ** k < n_max]
    return [*sizes, n_max]


def stratified_subsample(y: np.ndarray, n: int, rng: np.random.Generator,
                         task: str) -> np.ndarray:
    """Positions of n rows of y: per class in proportion (largest remainders), at least
    MIN_PER_CLASS of each class that has them; a plain random draw for regression."""
    if n >= len(y):
        return np.arange(len(y))
    if task != "classification":
        return np.sort(rng.choice(len(y), size=n, replace=False))
    classes, counts = np.unique(y, return_counts=True)
    exact = n * counts / counts.sum()
    least = np.minimum(MIN_PER_CLASS, counts)
    quota = np.minimum(counts, np.maximum(np.floor(exact).astype(int), least))
    while quota.sum() < n:  # hand out the rest by largest remainder, where rows are left
        room = quota < counts
        quota[np.flatnonzero(room)[np.argmax((exact - quota)[room])]] += 1
    while quota.sum() > n:  # the MIN_PER_CLASS floor overshot: take from the classes above
        spare = quota > least  # their floor that are furthest over their exact share
        quota[np.flatnonzero(spare)[np.argmax((quota - exact)[spare])]] -= 1
    picks = [rng.choice(np.flatnonzero(y == c), size=q, replace=False)
             for c, q in zip(classes, quota, strict=True)]
    return np.sort(np.concatenate(picks))


def fit_learning_curve(view: str, x: np.ndarray, y: np.ndarray, task: str, folds: int,
                       seed: int, sizes: Sequence[int] | None = None, repeats: int = 3
                       ) -> LearningCurve:
    """Score at increasing numbers of labelled rows, on the same folds as the probe."""
    minimum = _min_curve_size(y, task)
    _check_curve_options(sizes, repeats, minimum)
    splits = _splits(y, task, folds, seed)
    n_max = min(len(train) for train, _ in splits)
    chosen = curve_sizes(n_max, sizes, minimum)
    means, stds = [], []
    for n in chosen:
        scores = []
        for r in range(1 if n == n_max else repeats):
            for f, (train, test) in enumerate(splits):
                rng = np.random.default_rng([seed, r, f, n])
                # the last size is every training fold whole (folds differ by at most a
                # row), so that point is the probe's own cross-validated score
                sub = train if n == n_max else train[
                    stratified_subsample(y[train], n, rng, task)]
                pred, _ = _fit_predict(x[sub], y[sub], x[test], task, seed)
                scores.append(_score(y[test], pred, task))
        means.append(float(np.mean(scores)))
        stds.append(float(np.std(scores)))
    gain = _gain_per_doubling(chosen, means)
    return LearningCurve(view, list(chosen), means, stds, repeats, gain,
                         bool(len(chosen) > 1 and gain < FLAT_GAIN))


def _gain_per_doubling(sizes: Sequence[int], scores: Sequence[float]) -> float:
    """(score at the largest size − score at the largest size ≤ half of it) / doublings
    between them (the first size when none is that small)."""
    if len(sizes) < 2:
        return float("nan")
    last = sizes[-1]
    earlier = [i for i, n in enumerate(sizes[:-1]) if n <= last / 2] or [0]
    i = earlier[-1]
    return (scores[-1] - scores[i]) / float(np.log2(last / sizes[i]))


# ---- scalar mix ----------------------------------------------------------------------

def layer_views(store: Store, pooling: str) -> list[str]:
    """Single-layer views with `pooling` covering every hidden state 0..L, in layer order."""
    found: dict[int, str] = {}
    for name in store.views:
        layer, pool = _view_layer_pooling(store, name)
        spec = store.provenance.view_spec(name)
        if layer is not None and spec is not None and pool == pooling \
                and spec.combine == "none" and not spec.normalize:
            found.setdefault(layer, name)
    n_layers = max(found, default=-1)
    missing = [i for i in range(n_layers + 1) if i not in found]
    if not found or missing:
        raise ProbeError(f"--scalar-mix {pooling}: needs one single-layer {pooling} view per "
                         f"hidden state 0..L (missing layers {missing or 'all'}); extract "
                         "them with a sweep job such as jobs/sweep.yaml")
    return [found[i] for i in range(n_layers + 1)]


def learn_scalar_mix(store: Store, ok: np.ndarray, y: np.ndarray, task: str, pooling: str,
                     folds: int, seed: int, say: Callable[[str], None] | None = None
                     ) -> MixResult:
    """Cross-validated scores of a learned mix, then the mix fitted on every row; `say`
    gets a line as each of the folds + 1 fits starts."""
    if pooling not in LINEAR_POOLINGS:
        raise ProbeError(f"--scalar-mix: pooling {pooling!r} is not linear in the token "
                         f"states, so a mix of pooled layers is not a scalar_mix view; use "
                         f"one of {', '.join(LINEAR_POOLINGS)}")
    names = layer_views(store, pooling)
    x = np.stack([store.vectors(n)[ok] for n in names]).astype(np.float32)  # (K, N, H)
    scores: dict[str, list[float]] = {}
    started = time.perf_counter()
    fits = folds + 1

    def progress(step: int, what: str) -> None:
        if say:
            say(f"probe: scalar mix ({pooling}, {len(names)} layers): fit {step}/{fits}, "
                f"{what} ({time.perf_counter() - started:.0f}s)")

    for i, (train, test) in enumerate(_splits(y, task, folds, seed), 1):
        progress(i, f"fold {i} of {folds}")
        model = _fit_mix(x[:, train], y[train], task, seed)
        fold = model.score(x[:, test], y[test])
        for k, v in fold.items():
            scores.setdefault(k, []).append(v)
    progress(fits, "every row, for the weights")
    final = _fit_mix(x, y, task, seed)
    return MixResult(pooling, final.s.tolist(), float(final.gamma), _summarise(scores))


@dataclass
class _MixModel:
    s: np.ndarray
    gamma: float
    head: Any  # fitted sklearn pipeline on the mixed features
    task: str

    def mixed(self, x: np.ndarray) -> np.ndarray:
        w = np.exp(self.s - self.s.max())
        w /= w.sum()
        return self.gamma * np.einsum("k,knh->nh", w, x)

    def score(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        from sklearn.metrics import accuracy_score, f1_score, r2_score

        pred = self.head.predict(self.mixed(x))
        if self.task == "classification":
            return {"accuracy": float(accuracy_score(y, pred)),
                    "macro_f1": float(f1_score(y, pred, average="macro"))}
        return {"r2": float(r2_score(y, pred))}


def _fit_mix(x: np.ndarray, y: np.ndarray, task: str, seed: int, epochs: int = 300
             ) -> _MixModel:
    """Learn s and a linear head jointly (Adam, full batch, features standardised with one
    mean/std shared by all layers, which commutes with the mix because Σ softmax(s) = 1),
    then refit the head alone as the usual standardised linear probe on the mixed features."""
    import torch
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    torch.manual_seed(seed)
    xt = torch.from_numpy(x)  # (K, N, H)
    # standardise per feature on the pooled statistics of all layers, so the mix weights
    # are not fighting scale differences between the embedding output and upper layers
    mu = xt.mean(dim=(0, 1), keepdim=True)
    sd = xt.std(dim=(0, 1), keepdim=True).clamp(min=1e-6)
    xn = (xt - mu) / sd
    k, _, h = xn.shape
    n_out = int(y.max()) + 1 if task == "classification" else 1
    s = torch.zeros(k, requires_grad=True)
    head = torch.nn.Linear(h, n_out)
    opt = torch.optim.Adam([s, *head.parameters()], lr=0.02)
    target = torch.from_numpy(y).long() if task == "classification" else \
        torch.from_numpy(y).float()
    for _ in range(epochs):
        opt.zero_grad()
        mixed = torch.einsum("k,knh->nh", torch.softmax(s, 0), xn)
        out = head(mixed)
        if task == "classification":
            loss = torch.nn.functional.cross_entropy(out, target)
        else:
            loss = torch.nn.functional.mse_loss(out[:, 0], target)
        loss = loss + 1e-3 * head.weight.pow(2).sum()
        loss.backward()
        opt.step()
    s_np = s.detach().numpy().astype(np.float64)
    # γ is one global scale: a standardised linear head absorbs it, so it is not
    # identifiable from a probe and is reported as 1.0
    gamma = 1.0
    probe = _logistic(seed, y) if task == "classification" else Ridge(alpha=1.0)
    model = _MixModel(s_np, gamma, make_pipeline(StandardScaler(), probe), task)
    model.head.fit(model.mixed(x), y)
    return model
