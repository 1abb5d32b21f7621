"""Probe output: a terminal table, a JSON file, and a self-contained HTML report."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from .page import counted
from .probe import FLAT_GAIN, ProbeReport, ProbeResult

# One colour per pooling, the same in every report (matplotlib's default cycle would hand
# them out in the order a store lists its views, so "mean" could be blue today, red next).
POOLING_COLOURS = {"mean": "#1f77b4", "cls": "#ff7f0e", "max": "#2ca02c",
                   "attention": "#d62728", "last": "#9467bd", "pooler": "#8c564b",
                   "tokens": "#e377c2"}
OTHER_COLOUR = "#7f7f7f"
MIX_COLOUR = "#17becf"  # the learned mix's bars: no pooling's colour


def pooling_colour(pooling: str) -> str:
    """A pooling's fixed colour; a post-processed view ('mean+center') keeps its pooling's."""
    return POOLING_COLOURS.get(pooling.split("+", 1)[0], OTHER_COLOUR)


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
    lines = [f"learning curve: {key} (mean ± std over {counted(report.n_folds, 'fold')} × "
             f"{counted(repeats, 'seed')}) vs labelled rows; the last size is each training "
             "fold whole",
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
    """Score by layer for each pooling (error bars = fold std), and the mix weights, as PNG."""
    import matplotlib.pyplot as plt

    fig = score_figure(report)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def score_figure(report: ProbeReport) -> Any:
    """The figure of `plot` (a matplotlib Figure; the caller closes it)."""
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
                    label=pooling, color=pooling_colour(pooling))
    others = [r for r in report.results if r.layer is None]
    for r in others:
        ax.axhline(r.metrics[key], linestyle=":", linewidth=1, color=pooling_colour(r.pooling),
                   label=f"{r.view} (multi-layer)")
    ax.axhline(report.baseline[key], color="grey", linestyle="--", label="baseline")
    _integer_ticks(ax)
    ax.set_xlabel("layer (hidden state; 0 = embeddings, k = output of block k)")
    ax.set_ylabel(f"{key} ({report.n_folds}-fold CV)")
    ax.set_title(f"Linear probe of {report.label!r} by layer and pooling")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if report.mix is not None:
        ax2 = axes[0][1]
        w = np.asarray(report.mix.softmax)
        ax2.bar(range(len(w)), w, color=MIX_COLOUR)
        ax2.set_xticks(range(len(w)))
        ax2.set_xlabel("layer (hidden state; 0 = embeddings)")
        ax2.set_ylabel("softmax(s)")
        ax2.set_title(f"Learned scalar mix ({report.mix.pooling}): "
                      f"{key} {report.mix.metrics[key]:.3f}")
        ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _integer_ticks(ax: Any) -> None:
    """Layers are whole numbers: no 2.5 between layer 2 and layer 3."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def render_html(report: ProbeReport, png: bytes, curve_png: bytes | None = None) -> str:
    img = base64.b64encode(png).decode()
    best = report.best().view
    mark = {True: ' class="best"', False: ""}
    rows = "".join(
        f"<tr{mark[r.view == best]}><td>{html.escape(r.view)}</td>"
        f"<td>{'' if r.layer is None else r.layer}</td><td>{_swatch(r.pooling)}"
        f"{html.escape(r.pooling)}</td>"
        + "".join(f"<td>{_pm(r.metrics, k)}</td>" for k in _metric_keys(report))
        + f"<td>{_strengths(r.regularisation)}</td></tr>"
        for r in sorted(report.results, key=lambda r: -r.metrics[report.score_key]))
    dropped = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in report.dropped.items()
                        if n) or "none"
    mix = ""
    if report.mix is not None:
        mix = (f"<h2>Scalar mix</h2><p>Learned over {counted(len(report.mix.weights), 'layer')}"
               f" (hidden states 0..{len(report.mix.weights) - 1}) with {report.mix.pooling} "
               f"pooling: {_pm(report.mix.metrics, report.score_key)} {report.score_key}. "
               "Paste into a job's views:</p>"
               f"<pre>{html.escape(report.mix.view_block())}</pre>")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>bertpipe probe: {html.escape(report.label)}</title><style>{PAGE_STYLE}</style></head><body>
<h1>Linear probe: {html.escape(report.label)}</h1>
<p class="rec">{html.escape(report.recommendation())}</p>
<p>{report.task}, {counted(report.n_rows, "row")}, {report.n_folds}-fold cross-validation,
seed {report.seed}; standardised features, {'logistic regression' if report.task ==
'classification' else 'ridge regression'}. Baseline
({'always the majority class' if report.task == 'classification' else 'always the mean'}):
{report.baseline[report.score_key]:.3f} {report.score_key}. Rows left out: {dropped}.
Layers are hidden states: 0 is the embeddings, k the output of transformer block k.</p>
<img alt="probe scores by layer" src="data:image/png;base64,{img}">
<div class="wide"><table><tr><th>view</th><th>layer</th><th>pooling</th>
{''.join(f'<th>{k}</th>' for k in _metric_keys(report))}<th>{_strength_title(report)}</th></tr>
{rows}</table></div>
{mix}{_curve_html(report, curve_png)}</body></html>
"""


# Fits any window: the figures shrink to the page's width, a wide table scrolls inside its
# own box, long lines wrap; nothing makes the page itself scroll sideways.
PAGE_STYLE = """
*{box-sizing:border-box}
body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1.5em;
 color:#222;line-height:1.4}
img{max-width:100%;height:auto;display:block;margin:1em 0}
.wide{overflow-x:auto;max-width:100%}
table{border-collapse:collapse}
td,th{padding:4px 10px;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f6f6f6;padding:.6em}
.rec{background:#eef6ee;padding:.8em;border-left:4px solid #393}
tr.best td{background:#eef6ee;font-weight:bold}
.swatch{display:inline-block;width:.8em;height:.8em;margin-right:.4em;border-radius:2px}
"""


def _swatch(pooling: str) -> str:
    """The pooling's colour in the figure, beside its name in the table."""
    return f'<span class="swatch" style="background:{pooling_colour(pooling)}"></span>'


def _strength_title(report: ProbeReport) -> str:
    if report.task == "classification":
        return "C per fold (inverse L2 strength: smaller = more regularised)"
    return "ridge alpha per fold (L2 strength)"


def _strengths(values: list[float]) -> str:
    """Each outer fold's regularisation (logistic C, or ridge alpha), compactly."""
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
    seeds = counted(max(c.repeats for c in report.curves), "seed")
    return (f"<h2>Learning curve: frozen features or fine-tuning?</h2><p>The probe refitted on "
            f"stratified subsamples of each training fold ({seeds} per fold), scored on the "
            f"fold's full test part; the last size is each "
            f"training fold whole. Flat means under {FLAT_GAIN} {key} gained per doubling of "
            f"labelled rows between the largest size and the largest size at most half of it."
            f"</p><img alt=\"learning curve\" src=\"data:image/png;base64,{img}\">"
            f"<div class=\"wide\"><table><tr><th>view</th>{head}</tr>{''.join(rows)}</table>"
            f"</div><ul>{readings}</ul>")


def _metric_keys(report: ProbeReport) -> list[str]:
    return ["accuracy", "macro_f1"] if report.task == "classification" else ["r2", "spearman"]
