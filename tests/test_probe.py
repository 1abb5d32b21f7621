"""Linear probes on synthetic stores where the answer is known by construction."""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import pipeline
from pipeline.analysis.probe import ProbeReport, ProbeResult, load_labels, run_probe
from pipeline.cli import main
from tests.conftest import (
    SYNTHETIC_LAYERS,
    SYNTHETIC_ROWS,
    SYNTHETIC_WIDTH,
    browse,
    screenshot,
    synthetic_store,
    write_table,
)

pytestmark = pytest.mark.usefixtures("one_thread")
N, H, LAYERS = SYNTHETIC_ROWS, SYNTHETIC_WIDTH, SYNTHETIC_LAYERS  # hidden states 0..3


@pytest.fixture
def store(tmp_path: Path) -> pipeline.Store:
    return synthetic_store(tmp_path / "s.zarr")


def test_informative_view_ranks_first_and_noise_near_baseline(store: pipeline.Store) -> None:
    report = run_probe(store, load_labels(store, "label"))
    scores = {r.view: r.metrics["accuracy"] for r in report.results}
    assert report.best().view == "l2_mean" and scores["l2_mean"] > 0.9
    assert scores["noise"] < report.baseline["accuracy"] + 0.15
    assert all(scores["l2_mean"] > s for v, s in scores.items() if v != "l2_mean")
    assert report.best().layer == 2
    assert 0.3 < report.baseline["accuracy"] < 0.45  # three balanced-ish classes
    assert "l2_mean" in report.recommendation()


@pytest.mark.slow  # a learned scalar mix: hundreds of Adam steps per fold
def test_scalar_mix_recovers_the_informative_layer(store: pipeline.Store) -> None:
    report = run_probe(store, load_labels(store, "label"), scalar_mix="mean")
    assert report.mix is not None
    weights = report.mix.softmax
    assert int(np.argmax(weights)) == 2 and weights[2] > 0.5
    assert report.mix.metrics["accuracy"] > 0.85
    block = report.mix.view_block()
    assert block.startswith("probe_mix: {layers: all, combine: scalar_mix, weights: [")
    # the block is a view the extractor accepts
    import yaml

    from pipeline.spec import _view_from_dict

    name, body = next(iter(yaml.safe_load(block).items()))
    assert _view_from_dict(name, body).weights == pytest.approx(report.mix.weights, abs=1e-4)


@pytest.mark.slow  # a learned scalar mix: hundreds of Adam steps per fold
def test_deterministic_with_fixed_seed(store: pipeline.Store) -> None:
    labels = load_labels(store, "label")
    a = run_probe(store, labels, seed=3, scalar_mix="mean").to_dict()
    b = run_probe(store, labels, seed=3, scalar_mix="mean").to_dict()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    # and the seed is used: another one splits the folds (and starts the mix) elsewhere
    c = run_probe(store, labels, seed=4, scalar_mix="mean").to_dict()
    assert json.dumps(a, sort_keys=True) != json.dumps(c, sort_keys=True)


def test_regression_labels(tmp_path: Path) -> None:
    store = synthetic_store(tmp_path / "r.zarr")
    target = store.vectors("l1_mean")[:, 0] * 3 + np.random.default_rng(1).normal(size=N) * 0.1
    report = run_probe(store, pipeline.analysis.probe.pd.Series(target, name="score"))
    assert report.task == "regression"
    best = report.best()
    assert best.view == "l1_mean" and best.metrics["r2"] > 0.9 and best.metrics["spearman"] > 0.9


@pytest.mark.slow  # a learned scalar mix: hundreds of Adam steps per fold
def test_cli_writes_table_json_html(store: pipeline.Store, tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["probe", store.path, "--label", "label", "--layers",
                                       "--scalar-mix", "mean", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "l2_mean" in result.stdout and "baseline" in result.stdout
    assert "paste into a job's views" in result.stdout
    data = json.loads((out / "probe.json").read_text())
    assert {r["view"] for r in data["results"]} == {f"l{i}_mean" for i in range(LAYERS)} | {
        "noise"}
    page = (out / "probe.html").read_text()
    assert "data:image/png;base64," in page and html.escape(data["recommendation"]) in page
    assert (out / "probe.png").read_bytes()[:4] == b"\x89PNG"
    # progress per view on stderr, the chosen regularisation per fold, the best row marked
    progress = [line for line in result.stderr.splitlines() if "probe: view" in line]
    assert len(progress) == len(data["results"]) and progress[-1].count("/") >= 1
    # the scalar mix says where it is: each fold's fit, then the fit on every row
    mix = [line for line in result.stderr.splitlines() if "probe: scalar mix" in line]
    folds = data["n_folds"]
    assert [line.split("fit ")[1].split(",")[0] for line in mix] == \
        [f"{k}/{folds + 1}" for k in range(1, folds + 2)]
    assert "(mean, 4 layers)" in mix[0] and "every row" in mix[-1]
    assert "C per fold (inverse L2 strength" in page and "L2 per fold" not in page
    grid = {0.001, 0.01, 0.1, 1.0}  # the inner CV's candidates
    for r in data["results"]:
        assert len(r["regularisation"]) == data["n_folds"] and set(r["regularisation"]) <= grid
    best = max(data["results"], key=lambda r: r["metrics"]["accuracy"])["view"]
    assert f'<tr class="best"><td>{best}</td>' in page and page.count('class="best"') == 1
    assert data["dropped"] == {"no_vector": 0, "no_label": 0, "superseded": 0}


def test_rows_without_a_label_are_counted_as_dropped(store: pipeline.Store) -> None:
    labels = load_labels(store, "label").copy()
    labels.iloc[:7] = None
    report = run_probe(store, labels, ["l2_mean"], folds=2)
    assert report.dropped == {"no_vector": 0, "no_label": 7, "superseded": 0}
    assert report.n_rows == N - 7


def test_labels_joined_from_file(store: pipeline.Store, tmp_path: Path) -> None:
    ids = [f"d{i}" for i in range(N)]
    labels = np.asarray(store.docs["label"].values).tolist()
    path = write_table(tmp_path / "labels.parquet", {"doc_id": ids[::-1], "y": labels[::-1]})
    joined = load_labels(store, "y", str(path), "doc_id")
    assert joined.tolist() == labels


@pytest.mark.parametrize("case,fragment", [
    ("missing", "not a carried column"),
    ("constant", "label is constant"),
    ("singleton", "has 1 example"),
    ("unmatched", "no 'id' matches the store's ids"),
])
def test_label_errors(tmp_path: Path, case: str, fragment: str) -> None:
    labels = {"constant": np.array(["a"] * N),
              "singleton": np.array(["a", "b"] * (N // 2 - 1) + ["a", "c"])}
    store = synthetic_store(tmp_path / "e.zarr", labels=labels.get(case))
    runner = CliRunner()
    args = ["probe", store.path, "--label", "nope" if case == "missing" else "label"]
    if case == "unmatched":
        path = write_table(tmp_path / "l.parquet", {"id": ["x", "y"], "label": ["a", "b"]})
        args += ["--labels", str(path)]
    result = runner.invoke(main, args)
    assert result.exit_code == 3, result.output
    assert fragment in result.stderr and result.stderr.startswith("error: ")


def test_learning_curve_rises_then_flattens(tmp_path: Path) -> None:
    """A learnable but noisy signal: the probe gains with the first labels, then stops."""
    store = synthetic_store(tmp_path / "c.zarr", strength=1.0)
    out = tmp_path / "curve"
    result = CliRunner().invoke(main, [
        "probe", store.path, "--label", "label", "--views", "l2_mean", "--folds", "3",
        "--learning-curve", "--curve-sizes", "9,18,36,72", "--curve-repeats", "1",
        "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "probe.json").read_text())
    (curve,) = data["curves"]
    assert curve["sizes"] == [9, 18, 36, 72, 160]  # 160: every training fold whole
    mean = curve["mean"]
    assert mean[-1] - mean[0] > 0.03  # rises ...
    gain = (mean[-1] - mean[3]) / np.log2(160 / 72)  # ... and the last doubling is flat
    assert curve["gain_per_doubling"] == pytest.approx(gain) and gain < 0.01
    assert curve["flat"] and curve["reading"].startswith("flat")
    # the last point is the probe itself: same folds, whole training folds
    assert mean[-1] == pytest.approx(data["results"][0]["metrics"]["accuracy"], abs=1e-12)
    assert "learning curve: accuracy" in result.stdout and "l2_mean: flat (" in result.stdout
    assert "3 folds × 1 seed)" in result.stdout and "1 seeds" not in result.stdout
    page = (out / "probe.html").read_text()
    assert "(1 seed per fold)" in page and "1 seeds" not in page
    assert "Learning curve" in page and html.escape(curve["reading"]) in page
    assert (out / "learning-curve.png").read_bytes()[:4] == b"\x89PNG"


def test_learning_curve_reading_rule() -> None:
    """Gain per doubling between the largest size and the largest one at most half of it."""
    from pipeline.analysis.probe import FLAT_GAIN, LearningCurve, _gain_per_doubling

    sizes = [50, 100, 200, 400, 480]
    rising = [0.50, 0.60, 0.66, 0.70, 0.74]  # (0.74 - 0.66) / log2(480 / 200) = 0.0633
    assert _gain_per_doubling(sizes, rising) == pytest.approx(0.08 / np.log2(2.4))
    flat = [0.50, 0.60, 0.70, 0.705, 0.708]  # 0.008 / log2(2.4) = 0.0063
    assert _gain_per_doubling(sizes, flat) < FLAT_GAIN
    curve = LearningCurve("v", sizes, rising, [0.0] * 5, 3, 0.0633, False)
    assert curve.reading("accuracy").startswith("still rising (+0.063 accuracy per doubling")
    assert _gain_per_doubling([30, 40], [0.5, 0.6]) == pytest.approx(0.1 / np.log2(40 / 30))


def test_stratified_subsample_keeps_every_class() -> None:
    from pipeline.analysis.probe import MIN_PER_CLASS, stratified_subsample

    y = np.array([0] * 385 + [1] * 161 + [2] * 54)  # the sample reviews' label counts
    rng = np.random.default_rng(0)
    for n in (9, 50, 100, 599):
        picked = stratified_subsample(y, n, rng, "classification")
        counts = np.bincount(y[picked], minlength=3)
        assert len(np.unique(picked)) == len(picked) == n
        assert counts.min() >= MIN_PER_CLASS
        assert np.abs(counts - n * np.bincount(y) / len(y)).max() < MIN_PER_CLASS + 1
    assert stratified_subsample(y, 50, np.random.default_rng(1), "classification").tolist() \
        == stratified_subsample(y, 50, np.random.default_rng(1), "classification").tolist()


def test_learning_curve_bad_sizes(store: pipeline.Store) -> None:
    result = CliRunner().invoke(main, ["probe", store.path, "--label", "label", "--views",
                                       "l2_mean", "--learning-curve", "--curve-sizes", "4,50"])
    assert result.exit_code == 3 and "--curve-sizes: 4 rows is too few" in result.stderr
    result = CliRunner().invoke(main, ["probe", store.path, "--label", "label",
                                       "--learning-curve", "--curve-sizes", "a,b"])
    assert result.exit_code == 2 and "not a comma-separated list" in result.stderr
    result = CliRunner().invoke(main, ["probe", store.path, "--label", "label",
                                       "--learning-curve", "--curve-repeats", "0"])
    assert result.exit_code == 2 and "--curve-repeats: 0 must be at least 1" in result.stderr


def _report(poolings: list[str], task: str = "classification") -> ProbeReport:
    """A report made by hand: one view per (pooling, layer 0..6), scores rising with the
    layer; no fitting."""
    key = "accuracy" if task == "classification" else "r2"
    results = [ProbeResult(f"l{layer}_{pooling}", layer, pooling,
                           {key: 0.5 + layer / 100, f"{key}_std": 0.01, "macro_f1": 0.4,
                            "macro_f1_std": 0.01, "spearman": 0.1, "spearman_std": 0.0},
                           [0.1] * 5)
               for pooling in poolings for layer in range(7)]
    baseline = {key: 0.4, f"{key}_std": 0.0, "macro_f1": 0.2, "macro_f1_std": 0.0,
                "spearman": 0.0, "spearman_std": 0.0}
    return ProbeReport(task, "label", 100, 5, 0, baseline, results)


def test_figure_colours_are_fixed_per_pooling_and_layers_are_whole() -> None:
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    from pipeline.analysis.report import POOLING_COLOURS, render_html, score_figure

    colours = []
    for order in (["mean", "cls", "max"], ["max", "attention", "mean"], ["cls"]):
        fig = score_figure(_report(order))
        ax = fig.axes[0]
        lines = {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()
                 if not line.get_label().startswith("_") and line.get_label() != "baseline"}
        handles, labels = ax.get_legend_handles_labels()
        for handle, label in zip(handles, labels, strict=True):
            if label != "baseline":
                lines[label] = to_hex(handle[0].get_color())
        colours.append(lines)
        ticks = [float(t) for t in ax.get_xticks() if 0 <= t <= 6]
        assert ticks and all(t.is_integer() for t in ticks), ticks
        plt.close(fig)
    assert colours[0]["mean"] == colours[1]["mean"] == POOLING_COLOURS["mean"]
    assert colours[0]["max"] == colours[1]["max"] == POOLING_COLOURS["max"]
    assert colours[0]["cls"] == colours[2]["cls"] == POOLING_COLOURS["cls"]
    assert len(set(POOLING_COLOURS.values())) == len(POOLING_COLOURS)
    # the regularisation column says what it holds, for both tasks
    page = render_html(_report(["mean"]), b"png")
    assert "C per fold (inverse L2 strength: smaller = more regularised)" in page
    assert "ridge alpha per fold (L2 strength)" in render_html(_report(["mean"], "regression"),
                                                                b"png")


# Inside the page: every figure decoded and within the window.
LAYOUT = """
return [...document.images].map((img) => {
  const box = img.getBoundingClientRect();
  return {right: box.right, width: box.width, natural: img.naturalWidth};
});
"""


@pytest.mark.slow  # end to end (real processes, servers or a browser): not in make test-fast
@pytest.mark.parametrize("width", [1280, 1920])
def test_probe_page_fits_the_window_in_headless_chromium(store: pipeline.Store, tmp_path: Path,
                                                         width: int) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(main, ["probe", store.path, "--label", "label", "--views",
                                       "l1_mean,l2_mean,noise", "--folds", "2",
                                       "--scalar-mix", "mean",  # the widest figure
                                       "--learning-curve", "--curve-sizes", "30",
                                       "--curve-repeats", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    page = out / "probe.html"
    seen = browse(page, tmp_path, LAYOUT, width=width, height=1000)
    assert not seen["problems"] and not seen["resources"], seen  # no errors, no requests
    assert seen["scroll_width"] <= seen["inner_width"], seen  # no horizontal scrollbar
    images = seen["result"]
    assert len(images) == 2 and all(i["natural"] > 0 for i in images)  # both figures drawn
    assert all(i["right"] <= seen["inner_width"] for i in images), images
    text = page.read_text()
    assert '<tr class="best"><td>l2_mean</td>' in text and "Linear probe: label" in text
    pixels = screenshot(page, tmp_path, width, 1000)
    mean_blue = (np.abs(pixels - np.array([0x1F, 0x77, 0xB4])).max(axis=-1) < 12)
    assert mean_blue.sum() > 100  # the mean pooling's line, in its fixed colour
