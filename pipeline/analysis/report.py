"""Probe output: a terminal table, a JSON file, and a self-contained HTML report."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np

from .probe import FLAT_GAIN, ProbeReport, ProbeResult


def table(report: ProbeReport) -> str:
    key = report.score_key
    second = "macro_f1" if report.task == "classification" else "spearman"
    lines = [f"{report.task} probe of {report.label!r}: {report.n_rows} rows, "
             f"{report.n_folds}-fold CV, seed {report.seed}",
             f"{'view':<16}{'layer':>6}  {'pooling':<10}{key:>16}{second:>18}"]
    rows = sorted(report.results, key=lambda r: -r.metrics[key])
    for r in rows:
        layer = "" if r.layer is None else str(r.layer)
        lines.append(f"{r.view:<16}{layer:>6}  {r.pooling:<10}"
                     f"{_pm(r.metrics, key):>16}{_pm(r.metrics, second):>18}")
    lines.append(f"{'baseline':<16}{'':>6}  {'majority' if key == 'accuracy' else 'mean':<10}"
                 f"{report.baseline[key]:>16.3f}{report.baseline[second]:>18.3f}")
    if report.mix is not None:
        mix = report.mix
        lines.append(f"scalar mix ({mix.pooling}): {_pm(mix.metrics, key)} {key}; softmax "
                     "weights " + ", ".join(f"L{i} {w:.2f}" for i, w in enumerate(mix.softmax)))
        lines.append("  paste into a job's views:  " + mix.view_block())
    lines.extend(curve_lines(report))
    if any(report.dropped.values()):
        lines.append("rows left out: " + ", ".join(
            f"{n} {why.replace('_', ' ')}" for why, n in report.dropped.items() if n))
    lines.append(report.recommendation())
    return "\n".join(lines)


def curve_lines(report: ProbeReport) -> list[str]:
    """The learning curves as a sizes × views block, each with its reading."""
    if not report.curves:
        return []
    key = report.score_key
    sizes = sorted({n for c in report.curves for n in c.sizes})
    repeats = max(c.repeats for c in report.curves)
    lines = [f"learning curve: {key} (mean ± std over {report.n_folds} folds × {repeats} "
             f"seeds) vs labelled rows; the last size is each training fold whole",
             f"{'view':<16}" + "".join(f"{n:>15}" for n in sizes)]
    for c in report.curves:
        cells = dict(zip(c.sizes, zip(c.mean, c.std, strict=True), strict=True))
        lines.append(f"{c.view:<16}" + "".join(
            f"{f'{cells[n][0]:.3f} ± {cells[n][1]:.3f}':>15}" if n in cells else f"{'':>15}"
            for n in sizes))
    lines.extend(f"  {c.view}: {c.reading(key)}" for c in report.curves)
    return lines


def _pm(metrics: dict[str, float], key: str) -> str:
    return f"{metrics[key]:.3f} ± {metrics[key + '_std']:.3f}" if key in metrics else ""


def write_outputs(report: ProbeReport, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "probe.json", "html": out / "probe.html", "png": out / "probe.png"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=1))
    png = plot(report)
    paths["png"].write_bytes(png)
    curve_png = None
    if report.curves:
        paths["curve_png"] = out / "learning-curve.png"
        curve_png = plot_curves(report)
        paths["curve_png"].write_bytes(curve_png)
    paths["html"].write_text(render_html(report, png, curve_png))
    return paths


def plot_curves(report: ProbeReport) -> bytes:
    """Score vs labelled rows (log scale), one line per view, error bars = std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = report.score_key
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for c in report.curves:
        ax.errorbar(c.sizes, c.mean, yerr=c.std, marker="o", capsize=3, label=c.view)
    ax.axhline(report.baseline[key], color="grey", linestyle="--", label="baseline")
    ax.set_xscale("log", base=2)
    sizes = sorted({n for c in report.curves for n in c.sizes})
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("labelled rows (training fold subsample)")
    ax.set_ylabel(key)
    ax.set_title(f"Learning curve of the probe of {report.label!r}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def plot(report: ProbeReport) -> bytes:
    """Score by layer for each pooling (error bars = fold std), and the mix weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = report.score_key
    panels = 2 if report.mix is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    by_pooling: dict[str, list[ProbeResult]] = {}
    for r in report.results:
        if r.layer is not None:
            by_pooling.setdefault(r.pooling, []).append(r)
    for pooling, results in sorted(by_pooling.items()):
        results.sort(key=lambda r: r.layer or 0)
        ax.errorbar([r.layer for r in results], [r.metrics[key] for r in results],
                    yerr=[r.metrics[f"{key}_std"] for r in results], marker="o", capsize=3,
                    label=pooling)
    others = [r for r in report.results if r.layer is None]
    for r in others:
        ax.axhline(r.metrics[key], linestyle=":", linewidth=1, label=f"{r.view} (multi-layer)")
    ax.axhline(report.baseline[key], color="grey", linestyle="--", label="baseline")
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel(f"{key} ({report.n_folds}-fold CV)")
    ax.set_title(f"Linear probe of {report.label!r} by layer and pooling")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if report.mix is not None:
        ax2 = axes[0][1]
        w = np.asarray(report.mix.softmax)
        ax2.bar(range(len(w)), w, color="tab:purple")
        ax2.set_xlabel("layer")
        ax2.set_ylabel("softmax(s)")
        ax2.set_title(f"Learned scalar mix ({report.mix.pooling}): "
                      f"{key} {report.mix.metrics[key]:.3f}")
        ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def render_html(report: ProbeReport, png: bytes, curve_png: bytes | None = None) -> str:
    img = base64.b64encode(png).decode()
    best = report.best().view
    mark = {True: ' class="best"', False: ""}
    rows = "".join(
        f"<tr{mark[r.view == best]}><td>{html.escape(r.view)}</td>"
        f"<td>{'' if r.layer is None else r.layer}</td><td>{r.pooling}</td>"
        + "".join(f"<td>{_pm(r.metrics, k)}</td>" for k in _metric_keys(report))
        + f"<td>{_strengths(r.regularisation)}</td></tr>"
        for r in sorted(report.results, key=lambda r: -r.metrics[report.score_key]))
    dropped = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in report.dropped.items()
                        if n) or "none"
    mix = ""
    if report.mix is not None:
        mix = (f"<h2>Scalar mix</h2><p>Learned over {len(report.mix.weights)} layers with "
               f"{report.mix.pooling} pooling: {_pm(report.mix.metrics, report.score_key)} "
               f"{report.score_key}.</p><pre>{html.escape(report.mix.view_block())}</pre>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>bertpipe probe: {html.escape(report.label)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}
table{{border-collapse:collapse}}td,th{{padding:4px 10px;border-bottom:1px solid #ddd}}
.rec{{background:#eef6ee;padding:.8em;border-left:4px solid #393}}
tr.best td{{background:#eef6ee;font-weight:bold}}</style></head><body>
<h1>Linear probe: {html.escape(report.label)}</h1>
<p class="rec">{html.escape(report.recommendation())}</p>
<p>{report.task}, {report.n_rows} rows, {report.n_folds}-fold cross-validation, seed
{report.seed}; standardised features, {'logistic regression' if report.task ==
'classification' else 'ridge regression'}. Baseline:
{report.baseline[report.score_key]:.3f} {report.score_key}. Rows left out: {dropped}.</p>
<img alt="probe scores by layer" src="data:image/png;base64,{img}">
<table><tr><th>view</th><th>layer</th><th>pooling</th>
{''.join(f'<th>{k}</th>' for k in _metric_keys(report))}<th>L2 per fold</th></tr>{rows}</table>
{mix}{_curve_html(report, curve_png)}</body></html>
"""


def _strengths(values: list[float]) -> str:
    """The L2 strength of each outer fold (logistic C, or ridge alpha), compactly."""
    return " ".join(f"{v:g}" for v in values)


def _curve_html(report: ProbeReport, png: bytes | None) -> str:
    if not report.curves or png is None:
        return ""
    key = report.score_key
    sizes = sorted({n for c in report.curves for n in c.sizes})
    head = "".join(f"<th>{n}</th>" for n in sizes)
    rows = []
    for c in report.curves:
        cells = dict(zip(c.sizes, zip(c.mean, c.std, strict=True), strict=True))
        tds = "".join(f"<td>{cells[n][0]:.3f} ± {cells[n][1]:.3f}</td>" if n in cells
                      else "<td></td>" for n in sizes)
        rows.append(f"<tr><td>{html.escape(c.view)}</td>{tds}</tr>")
    readings = "".join(f"<li><b>{html.escape(c.view)}</b>: {html.escape(c.reading(key))}</li>"
                       for c in report.curves)
    img = base64.b64encode(png).decode()
    return (f"<h2>Learning curve: frozen features or fine-tuning?</h2><p>The probe refitted on "
            f"stratified subsamples of each training fold ({max(c.repeats for c in report.curves)}"
            f" seeds per fold), scored on the fold's full test part; the last size is each "
            f"training fold whole. Flat means under {FLAT_GAIN} {key} gained per doubling of "
            f"labelled rows between the largest size and the largest size at most half of it."
            f"</p><img alt=\"learning curve\" src=\"data:image/png;base64,{img}\">"
            f"<table><tr><th>view</th>{head}</tr>{''.join(rows)}</table><ul>{readings}</ul>")


def _metric_keys(report: ProbeReport) -> list[str]:
    return ["accuracy", "macro_f1"] if report.task == "classification" else ["r2", "spearman"]
