"""What `bertpipe attention` writes: one row's maps (`RowAttention`: `attention.npz` and
`attention.html`) and the head summary (`HeadSummary`: `attention-summary.json` and
`attention-summary.html`), each page one self-contained file. `attention.py` computes
them; the records live here, with their pages, so that the pages read them without
importing the code that runs the model.

The row page carries the weights as data (uint16 steps of 1/65535, base64, inline) and a
small hand-written script draws them: a layer × head picker of thumbnails, the chosen map
with every token labelled on both axes and a hover read-out (query, key, weight), a colour
bar whose scale is the map's own maximum or one shared across heads, and a head view in
the manner of bertviz (lines from each token to the tokens it attends to). Nothing is
fetched: the page works offline. The summary page is static SVG, one grid per statistic,
each with its own colour bar.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .page import counted, json_script

LOW = np.array([255.0, 255.0, 255.0])  # white at the bottom of a scale
HIGH = np.array([8.0, 48.0, 107.0])  # dark blue at its top
STEPS = 65535  # weights travel as uint16: |error| ≤ 0.5 / 65535, far below what is shown
LAYER_NOTE = ("Layer k is the attention inside transformer block k (k = 1..{n}); its output "
              "is hidden state k, as in every bertpipe view and probe. Hidden state 0, the "
              "embeddings, has no attention. Heads are numbered from 0.")


# ---- the results: one row's maps, the heads' summary, and their files ---------------

# what attention.HeadStatistics measures per head (its module docstring has the formulas),
# in the order every table and page shows them
STATISTICS = ("entropy", "distance", "cls", "sep", "punct")
STAT_TITLES = {
    "entropy": "mean entropy (nats)",
    "distance": "mean attention distance (tokens)",
    "cls": "share of attention on [CLS] (prefix specials)",
    "sep": "share of attention on [SEP] (suffix specials)",
    "punct": "share of attention on punctuation",
}


@dataclass
class RowAttention:
    """One row's chunk: its tokens and the attention maps of the chosen layers and heads."""

    row: int
    row_id: str
    chunk: int
    n_chunks: int
    span: tuple[int, int]  # characters of the row's text in this chunk
    token_ids: list[int]
    tokens: list[str]
    layers: list[int]  # 1-based: layer k is transformer block k
    heads: list[int]
    attentions: np.ndarray  # (layers, heads, T, T) float32, rows = queries
    model: str  # the model's name, not its path (see page.model_name)
    n_layers: int = 0  # of the model (0: unknown)

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"npz": out / "attention.npz", "html": out / "attention.html"}
        np.savez_compressed(paths["npz"], attentions=self.attentions,
                            tokens=np.asarray(self.tokens, dtype=str),
                            token_ids=np.asarray(self.token_ids, np.int64),
                            layers=np.asarray(self.layers, np.int64),
                            heads=np.asarray(self.heads, np.int64),
                            span=np.asarray(self.span, np.int64))
        paths["html"].write_text(render_row_html(self), encoding="utf-8")
        return paths


@dataclass
class HeadSummary:
    """Each statistic per (layer, head), a mean over the sampled rows' query tokens."""

    model: str
    layers: list[int]
    heads: list[int]
    rows: list[int]  # sampled rows that had text
    n_sampled: int
    n_empty: int
    n_queries: int
    uniform_entropy: float
    uniform_distance: float
    statistics: dict[str, np.ndarray]  # name -> (len(layers), len(heads))
    n_layers: int = 0  # of the model (0: unknown)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "layers": self.layers, "heads": self.heads,
            "rows": self.rows, "n_sampled": self.n_sampled, "n_empty": self.n_empty,
            "n_queries": self.n_queries, "uniform_entropy": self.uniform_entropy,
            "uniform_distance": self.uniform_distance,
            "definitions": STAT_TITLES,
            "statistics": {k: v.tolist() for k, v in self.statistics.items()},
        }

    def table(self) -> str:
        lines = [f"attention summary of {self.model}: first chunk of "
                 f"{counted(len(self.rows), 'sampled row')} ({self.n_empty} of "
                 f"{counted(self.n_sampled, 'sampled row')} empty), "
                 f"{counted(self.n_queries, 'query token')}; uniform attention would have "
                 f"entropy {self.uniform_entropy:.2f} and distance {self.uniform_distance:.2f}",
                 "layer k = the attention inside transformer block k (hidden state 0 is the "
                 "embeddings); heads from 0"]
        for name in STATISTICS:
            values = self.statistics[name]
            fmt = f"{{:>6.{_decimals(name)}f}}"
            lines.append("")
            lines.append(STAT_TITLES[name])
            lines.append("layer " + "".join(f"{'h' + str(h):>7}" for h in self.heads))
            for li, layer in enumerate(self.layers):
                lines.append(f"{layer:>5} " + "".join(" " + fmt.format(v) for v in values[li]))
        return "\n".join(lines)

    def save(self, out_dir: str | Path) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "attention-summary.json", "html": out / "attention-summary.html"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1))
        paths["html"].write_text(render_summary_html(self), encoding="utf-8")
        return paths


def _decimals(statistic: str) -> int:
    return 2 if statistic in ("entropy", "distance") else 3


# ---- colours ------------------------------------------------------------------------

def colours(values: np.ndarray, low: float, high: float) -> np.ndarray:
    """Linear white → dark blue over [low, high]; uint8 (..., 3)."""
    span = high - low
    scale = np.clip((values - low) / span, 0.0, 1.0) if span > 0 else np.zeros_like(values)
    return np.round(LOW + (HIGH - LOW) * scale[..., None]).astype(np.uint8)


def encode_weights(attentions: np.ndarray) -> str:
    """(layers, heads, T, T) weights in [0, 1] as base64 of little-endian uint16 steps."""
    steps = np.round(np.clip(attentions, 0.0, 1.0) * STEPS).astype("<u2")
    return base64.b64encode(steps.tobytes()).decode("ascii")


# ---- one row ---------------------------------------------------------------------------

ROW_STYLE = """
*{box-sizing:border-box}
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;line-height:1.4}
h1{font-size:1.5em;margin:0 0 .3em}
p.facts{max-width:70em;margin:.3em 0 .8em}
.controls{display:flex;flex-wrap:wrap;gap:.6em 1.6em;align-items:center;margin:.6em 0}
.controls label{white-space:nowrap}
fieldset{border:1px solid #ccc;padding:.2em .7em}
.picker{overflow-x:auto;max-width:100%;margin:.4em 0 .8em}
.picker table{border-collapse:collapse}
.picker th{font-weight:normal;font-size:12px;padding:0 4px;white-space:nowrap}
.picker td{padding:1px}
.picker canvas{display:block;width:44px;height:44px;image-rendering:pixelated;
 border:2px solid transparent;cursor:pointer}
.picker canvas.on{border-color:#e6550d}
.tabs button{font:inherit;padding:.3em 1em;border:1px solid #999;background:#f4f4f4;
 cursor:pointer}
.tabs button[aria-selected=true]{background:#08306b;color:#fff;border-color:#08306b}
.colourbar{display:flex;align-items:center;gap:.6em;margin:.6em 0;flex-wrap:wrap}
.colourbar canvas{width:240px;height:14px;border:1px solid #999}
.colourbar .ticks{display:flex;justify-content:space-between;width:240px;font-size:12px}
.scroll{overflow:auto;max-width:100%;max-height:88vh;border:1px solid #eee}
#map text{font-family:ui-monospace,monospace;cursor:default}
#map text.hot{font-weight:bold;fill:#e6550d}
.tip{position:fixed;pointer-events:none;background:#fffbe6;border:1px solid #c9a300;
 padding:.25em .5em;font-size:13px;display:none;z-index:2;white-space:nowrap}
.hv{display:flex;align-items:flex-start;font-family:ui-monospace,monospace;font-size:12px}
.hv .col div{height:16px;line-height:16px;padding:0 .4em;white-space:nowrap;cursor:default}
.hv .left div{text-align:right}
.hv .col div.hot{font-weight:bold;color:#e6550d}
.swatches{display:flex;flex-wrap:wrap;gap:4px;margin:.4em 0}
.swatches span{font-size:12px;padding:1px 6px;border-radius:3px;color:#fff;cursor:pointer}
.swatches span.off{opacity:.25}
.error{color:#b00;font-weight:bold}
"""

# The page's script: reads the inline data, draws on canvas and SVG, no library.
ROW_SCRIPT = r"""
(function () {
"use strict";
const D = JSON.parse(document.getElementById("attention-data").textContent);
const T = D.tokens.length, NL = D.layers.length, NH = D.heads.length, N2 = T * T;
const raw = atob(D.weights);
const W = new Float32Array(NL * NH * N2);
for (let k = 0; k < W.length; k++) {
  W[k] = (raw.charCodeAt(2 * k) | (raw.charCodeAt(2 * k + 1) << 8)) / D.steps;
}
const maxOf = new Float32Array(NL * NH);
for (let m = 0; m < NL * NH; m++) {
  let top = 0;
  for (let k = m * N2; k < (m + 1) * N2; k++) if (W[k] > top) top = W[k];
  maxOf[m] = top;
}
const LOW = [255, 255, 255], HIGH = [8, 48, 107];
const HEAD_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39",
  "#7b4173", "#3182bd"];
const state = {l: 0, h: 0, scale: "map", tab: "map", allHeads: false, hover: null};
const $ = (id) => document.getElementById(id);
const svgNS = "http://www.w3.org/2000/svg";
const w = (l, h, i, j) => W[(l * NH + h) * N2 + i * T + j];
const tok = (i) => D.tokens[i];
const fmt = (v) => v.toFixed(4);

function top(l, h) {
  if (state.scale === "unit") return 1;
  let best = 0;
  for (let ll = 0; ll < NL; ll++) {
    if (state.scale !== "all" && ll !== l) continue;
    for (let hh = 0; hh < NH; hh++) {
      if (state.scale === "map" && hh !== h) continue;
      best = Math.max(best, maxOf[ll * NH + hh]);
    }
  }
  return best > 0 ? best : 1;
}
function colour(v, t) {
  const s = Math.min(Math.max(v / t, 0), 1);
  return [0, 1, 2].map((c) => Math.round(LOW[c] + (HIGH[c] - LOW[c]) * s));
}
function paint(canvas, l, h, t) {  // one pixel per weight
  canvas.width = T; canvas.height = T;
  const ctx = canvas.getContext("2d"), img = ctx.createImageData(T, T);
  for (let k = 0; k < N2; k++) {
    const c = colour(W[(l * NH + h) * N2 + k], t);
    img.data[4 * k] = c[0]; img.data[4 * k + 1] = c[1]; img.data[4 * k + 2] = c[2];
    img.data[4 * k + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
}
function thumbnail(canvas, l, h, t) {
  // at most 44 × 44 pixels, each the largest weight of its block: a thin diagonal or one
  // strong key stays visible where plain downsampling would drop it
  const n = Math.min(T, 44), ctx = (canvas.width = n, canvas.height = n, canvas.getContext("2d"));
  const img = ctx.createImageData(n, n), base = (l * NH + h) * N2;
  for (let y = 0; y < n; y++) for (let x = 0; x < n; x++) {
    let v = 0;
    for (let i = Math.floor(y * T / n); i < Math.floor((y + 1) * T / n); i++)
      for (let j = Math.floor(x * T / n); j < Math.floor((x + 1) * T / n); j++)
        v = Math.max(v, W[base + i * T + j]);
    const c = colour(v, t), k = 4 * (y * n + x);
    img.data[k] = c[0]; img.data[k + 1] = c[1]; img.data[k + 2] = c[2]; img.data[k + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
}
function layerName(l) { return "layer " + D.layers[l]; }
function mapName(l, h) { return layerName(l) + ", head " + D.heads[h]; }

// ---- the picker: one thumbnail per layer and head, drawn on the chosen scale
function buildPicker() {
  const table = document.createElement("table");
  const head = table.insertRow();
  head.appendChild(document.createElement("th"));
  for (let h = 0; h < NH; h++) {
    const th = document.createElement("th"); th.textContent = "head " + D.heads[h];
    head.appendChild(th);
  }
  for (let l = 0; l < NL; l++) {
    const row = table.insertRow();
    const th = document.createElement("th"); th.textContent = layerName(l);
    row.appendChild(th);
    for (let h = 0; h < NH; h++) {
      const canvas = document.createElement("canvas");
      canvas.id = "thumb-" + l + "-" + h;
      canvas.title = mapName(l, h) + ": largest weight " + fmt(maxOf[l * NH + h]);
      canvas.addEventListener("click", () => select(l, h));
      row.insertCell().appendChild(canvas);
    }
  }
  $("picker").appendChild(table);
}
function drawPicker() {
  for (let l = 0; l < NL; l++) for (let h = 0; h < NH; h++) {
    const canvas = $("thumb-" + l + "-" + h);
    thumbnail(canvas, l, h, top(l, h));
    canvas.classList.toggle("on", l === state.l && h === state.h);
  }
}

// ---- the colour bar of the chosen scale
const SCALE_TEXT = {
  map: "this map's own largest weight",
  layer: "the largest weight of any head of this layer (shared across its heads)",
  all: "the largest weight of any layer and head on this page (shared by all maps)",
  unit: "1, the largest possible weight (absolute)",
};
function drawColourbar() {
  const t = top(state.l, state.h), canvas = $("bar");
  canvas.width = 240; canvas.height = 1;
  const ctx = canvas.getContext("2d"), img = ctx.createImageData(240, 1);
  for (let x = 0; x < 240; x++) {
    const c = colour(t * x / 239, t);
    img.data.set([c[0], c[1], c[2], 255], 4 * x);
  }
  ctx.putImageData(img, 0, 0);
  $("tick-mid").textContent = (t / 2).toFixed(3);
  $("tick-top").textContent = t.toFixed(3);
  $("bar-text").textContent = "attention weight: white = 0, dark blue = " + t.toFixed(3) +
    ", " + SCALE_TEXT[state.scale] + "; darker weights are clipped to the darkest blue.";
}

// ---- the map: every token labelled on both axes, hover read-out
let cell = 12, margin = 60;
const titles = {q: [], k: []};  // the hover text of every token label, on both axes
function buildMap() {
  const longest = Math.max(...D.tokens.map((s) => Math.min(s.length, 16)));
  cell = Math.max(11, Math.min(18, Math.floor(760 / T)));
  margin = 12 + Math.ceil(longest * cell * 0.62);
  const size = margin + T * cell + 4, svg = $("map");
  svg.setAttribute("width", size); svg.setAttribute("height", size);
  svg.setAttribute("font-size", Math.max(9, cell - 2));
  const label = (i, axis) => {
    const t = document.createElementNS(svgNS, "text");
    t.textContent = tok(i).length > 16 ? tok(i).slice(0, 15) + "\u2026" : tok(i);
    t.setAttribute("dominant-baseline", "middle");
    t.id = axis + "-" + i;
    if (axis === "q") {
      t.setAttribute("x", margin - 4); t.setAttribute("y", margin + (i + 0.5) * cell);
      t.setAttribute("text-anchor", "end");
    } else {
      t.setAttribute("transform", "translate(" + (margin + (i + 0.5) * cell) + "," +
        (margin - 4) + ") rotate(-90)");
    }
    const title = document.createElementNS(svgNS, "title");
    t.appendChild(title);
    titles[axis].push(title);
    svg.appendChild(t);
  };
  for (let i = 0; i < T; i++) { label(i, "q"); label(i, "k"); }
  const image = document.createElementNS(svgNS, "image");
  image.id = "map-image";
  for (const [k, v] of [["x", margin], ["y", margin], ["width", T * cell],
                        ["height", T * cell], ["preserveAspectRatio", "none"]]) {
    image.setAttribute(k, v);
  }
  image.style.imageRendering = "pixelated";
  svg.appendChild(image);
  const frame = document.createElementNS(svgNS, "rect");
  for (const [k, v] of [["x", margin], ["y", margin], ["width", T * cell],
                        ["height", T * cell], ["fill", "none"], ["stroke", "#999"]]) {
    frame.setAttribute(k, v);
  }
  svg.appendChild(frame);
  const cross = document.createElementNS(svgNS, "rect");
  cross.id = "map-cell";
  for (const [k, v] of [["width", cell], ["height", cell], ["fill", "none"],
                        ["stroke", "#e6550d"], ["stroke-width", 2], ["visibility", "hidden"]]) {
    cross.setAttribute(k, v);
  }
  svg.appendChild(cross);
  svg.addEventListener("mousemove", hoverMap);
  svg.addEventListener("mouseleave", () => showCell(null));
}
function topKeys(l, h, i, count) {
  const order = [...Array(T).keys()].sort((a, b) => w(l, h, i, b) - w(l, h, i, a));
  return order.slice(0, count).map((j) => tok(j) + " " + w(l, h, i, j).toFixed(3)).join(", ");
}
function topQueries(l, h, j, count) {
  const order = [...Array(T).keys()].sort((a, b) => w(l, h, b, j) - w(l, h, a, j));
  return order.slice(0, count).map((i) => tok(i) + " " + w(l, h, i, j).toFixed(3)).join(", ");
}
function drawMap() {
  const {l, h} = state, canvas = document.createElement("canvas");
  paint(canvas, l, h, top(l, h));
  $("map-image").setAttribute("href", canvas.toDataURL());
  for (let i = 0; i < T; i++) {
    titles.q[i].textContent = "query " + i + " \u201c" + tok(i) +
      "\u201d attends most to: " + topKeys(l, h, i, 3);
    titles.k[i].textContent = "key " + i + " \u201c" + tok(i) +
      "\u201d is attended most by: " + topQueries(l, h, i, 3);
  }
  let entropy = 0;
  for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
    const p = w(l, h, i, j);
    if (p > 0) entropy -= p * Math.log(p);
  }
  $("map-title").textContent = mapName(l, h) + ": queries down the left (each row sums to " +
    "1), keys along the top; largest weight " + fmt(maxOf[l * NH + h]) +
    ", mean entropy " + (entropy / T).toFixed(2) + " nats (uniform: " +
    Math.log(T).toFixed(2) + ")";
}
function hoverMap(event) {
  const box = $("map").getBoundingClientRect();
  const j = Math.floor((event.clientX - box.left - margin) / cell);
  const i = Math.floor((event.clientY - box.top - margin) / cell);
  showCell(i >= 0 && i < T && j >= 0 && j < T ? [i, j] : null, event);
}
function showCell(at, event) {
  const tip = $("tip"), mark = $("map-cell");
  if (state.hover) {
    $("q-" + state.hover[0]).classList.remove("hot");
    $("k-" + state.hover[1]).classList.remove("hot");
  }
  state.hover = at;
  if (!at) { tip.style.display = "none"; mark.setAttribute("visibility", "hidden"); return; }
  const [i, j] = at, {l, h} = state;
  tip.textContent = "query " + i + " \u201c" + tok(i) + "\u201d \u2192 key " + j + " \u201c" +
    tok(j) + "\u201d: " + fmt(w(l, h, i, j)) + " (" + mapName(l, h) + ")";
  tip.style.display = "block";
  if (event) {
    tip.style.left = (event.clientX + 14) + "px"; tip.style.top = (event.clientY + 14) + "px";
  }
  mark.setAttribute("x", margin + j * cell); mark.setAttribute("y", margin + i * cell);
  mark.setAttribute("visibility", "visible");
  $("q-" + i).classList.add("hot"); $("k-" + j).classList.add("hot");
}

// ---- the head view: lines from each query (left) to the keys it attends to (right)
const ROW = 16, GAP = 220;
let focus = null;  // {side: "q" | "k", i}
function buildHeadView() {
  for (const side of ["left", "right"]) {
    const col = $("hv-" + side);
    for (let i = 0; i < T; i++) {
      const div = document.createElement("div");
      div.textContent = tok(i);
      div.id = "hv-" + side + "-" + i;
      const role = side === "left" ? "q" : "k";
      div.addEventListener("mouseenter", () => { focus = {side: role, i}; drawHeadView(); });
      div.addEventListener("mouseleave", () => { focus = null; drawHeadView(); });
      col.appendChild(div);
    }
  }
  const canvas = $("hv-lines");
  canvas.width = GAP * devicePixelRatio; canvas.height = T * ROW * devicePixelRatio;
  canvas.style.width = GAP + "px"; canvas.style.height = T * ROW + "px";
  const swatches = $("hv-heads");
  for (let h = 0; h < NH; h++) {
    const span = document.createElement("span");
    span.textContent = "head " + D.heads[h];
    span.style.background = HEAD_COLOURS[h % HEAD_COLOURS.length];
    span.id = "swatch-" + h;
    span.title = "show head " + D.heads[h] + " of this layer";
    span.addEventListener("click", () => { state.allHeads = false; $("all-heads").checked = false;
                                          select(state.l, h); });
    swatches.appendChild(span);
  }
}
function drawHeadView() {
  const canvas = $("hv-lines"), ctx = canvas.getContext("2d"), {l} = state;
  ctx.setTransform(devicePixelRatio, 0, 0, devicePixelRatio, 0, 0);
  ctx.clearRect(0, 0, GAP, T * ROW);
  const heads = state.allHeads ? [...Array(NH).keys()] : [state.h];
  for (let h = 0; h < NH; h++) {
    $("swatch-" + h).classList.toggle("off", !heads.includes(h));
  }
  const shade = new Float32Array(T);
  for (const h of heads) {
    const t = top(l, h), rgb = HEAD_COLOURS[h % HEAD_COLOURS.length];
    ctx.strokeStyle = state.allHeads ? rgb : "#08306b";
    for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
      if (focus && (focus.side === "q" ? i !== focus.i : j !== focus.i)) continue;
      const a = Math.min(w(l, h, i, j) / t, 1);
      if (a < 0.02) continue;
      if (focus) shade[focus.side === "q" ? j : i] = Math.max(shade[focus.side === "q" ? j : i], a);
      ctx.globalAlpha = focus ? a : a * 0.6;
      ctx.lineWidth = focus ? 2 : 1;
      ctx.beginPath();
      ctx.moveTo(0, (i + 0.5) * ROW);
      ctx.lineTo(GAP, (j + 0.5) * ROW);
      ctx.stroke();
    }
  }
  ctx.globalAlpha = 1;
  for (let i = 0; i < T; i++) {
    for (const [side, other] of [["left", "q"], ["right", "k"]]) {
      const div = $("hv-" + side + "-" + i);
      const lit = focus && focus.side !== other ? shade[i] : 0;
      div.style.background = lit ? "rgba(8,48,107," + (0.6 * lit).toFixed(3) + ")" : "";
      div.style.color = lit > 0.5 ? "#fff" : "";
      div.classList.toggle("hot", !!focus && focus.side === other && focus.i === i);
      const h = state.h;
      div.title = other === "q"
        ? "query " + i + " \u201c" + tok(i) + "\u201d, " + mapName(l, h) + ": " +
          topKeys(l, h, i, 3)
        : "key " + i + " \u201c" + tok(i) + "\u201d, " + mapName(l, h) + ": " +
          topQueries(l, h, i, 3);
    }
  }
  $("hv-title").textContent = (state.allHeads ? layerName(l) + ", every head in its colour"
    : mapName(l, state.h)) + ": lines from each token on the left (the query) to the tokens " +
    "it attends to on the right (keys); the darker the line, the larger the weight (on " +
    "the colour bar's scale). Point at a token to see its lines alone.";
}

// ---- choosing
function select(l, h) {
  state.l = Math.max(0, Math.min(NL - 1, l)); state.h = Math.max(0, Math.min(NH - 1, h));
  $("layer").value = String(state.l); $("head").value = String(state.h);
  redraw();
}
function redraw() {
  drawPicker(); drawColourbar(); drawMap(); drawHeadView();
  $("chosen").textContent = mapName(state.l, state.h);
}
function options(id, labels) {
  const sel = $(id);
  labels.forEach((text, k) => sel.add(new Option(text, String(k))));
  sel.addEventListener("change", () => select(+$("layer").value, +$("head").value));
}
function showTab(name) {
  state.tab = name;
  for (const t of ["map", "headview"]) {
    $("tab-" + t).setAttribute("aria-selected", String(t === name));
    $("panel-" + t).hidden = t !== name;
  }
}

options("layer", D.layers.map((k) => "layer " + k + " (block " + k + ")"));
options("head", D.heads.map((h) => "head " + h));
for (const radio of document.querySelectorAll("input[name=scale]")) {
  radio.addEventListener("change", () => { state.scale = radio.value; redraw(); });
}
$("all-heads").addEventListener("change", (e) => { state.allHeads = e.target.checked;
                                                   drawHeadView(); });
$("tab-map").addEventListener("click", () => showTab("map"));
$("tab-headview").addEventListener("click", () => showTab("headview"));
document.addEventListener("keydown", (e) => {
  if (e.target instanceof HTMLSelectElement) return;
  const move = {ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0]};
  if (move[e.key]) { select(state.l + move[e.key][0], state.h + move[e.key][1]);
                     e.preventDefault(); }
});
buildPicker(); buildMap(); buildHeadView();
select(0, 0);
showTab("map");
document.body.dataset.ready = "true";
})();
"""


def render_row_html(r: RowAttention) -> str:
    n_layers = r.n_layers or max(r.layers, default=0)
    data = {"tokens": r.tokens, "layers": r.layers, "heads": r.heads, "steps": STEPS,
            "weights": encode_weights(r.attentions)}
    title = f"Attention of row {html.escape(r.row_id)} · {html.escape(r.model)}"
    scales = "".join(
        f'<label><input type="radio" name="scale" value="{value}"{" checked" * first}> '
        f'{text}</label> ' for first, (value, text) in zip(
            (True, False, False, False),
            (("map", "each map its own"), ("layer", "shared across the heads of a layer"),
             ("all", "shared across every map"), ("unit", "absolute, 0 to 1")), strict=True))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title><style>{ROW_STYLE}</style></head><body>
<h1>{title}</h1>
<p class="facts">Model <b>{html.escape(r.model)}</b>, eager attention in float32. Row {r.row}
(id {html.escape(r.row_id)}), {_chunk_text(r.chunk, r.n_chunks)} (characters
{r.span[0]}..{r.span[1]} of the row's text), {counted(len(r.tokens), "token")}, special
tokens included. {LAYER_NOTE.format(n=n_layers)} Each map: a row is a query token, a column
a key token; a row sums to 1. Pick a map below (or use the arrow keys); point at a cell
for its query, key and weight. Weights are shown to 4 decimals; attention.npz has them in
full.</p>
<div class="controls">
<label>Layer <select id="layer"></select></label>
<label>Head <select id="head"></select></label>
<fieldset><legend>Colour scale</legend>{scales}</fieldset>
</div>
<div class="picker" id="picker" aria-label="layer by head picker"></div>
<div class="colourbar"><div><canvas id="bar"></canvas><div class="ticks"><span>0</span>
<span id="tick-mid"></span><span id="tick-top"></span></div></div>
<span id="bar-text"></span></div>
<div class="tabs" role="tablist"><button id="tab-map" role="tab">Map</button><button
id="tab-headview" role="tab">Head view</button> <b id="chosen"></b></div>
<section id="panel-map"><p id="map-title"></p>
<div class="scroll"><svg id="map" xmlns="http://www.w3.org/2000/svg"></svg></div></section>
<section id="panel-headview" hidden><p id="hv-title"></p>
<label><input type="checkbox" id="all-heads"> every head of the layer at once, one colour
each</label><div class="swatches" id="hv-heads"></div>
<div class="scroll"><div class="hv"><div class="col left" id="hv-left"></div>
<canvas id="hv-lines"></canvas><div class="col right" id="hv-right"></div></div></div>
</section>
<div class="tip" id="tip" role="tooltip"></div>
<noscript><p class="error">This page draws its maps with JavaScript; attention.npz has the
same weights.</p></noscript>
{json_script("attention-data", data)}
<script>{ROW_SCRIPT}</script>
</body></html>
"""


def _chunk_text(chunk: int, n_chunks: int) -> str:
    if n_chunks == 1:
        return "its only chunk"
    return f"chunk {chunk} of its {n_chunks} (numbered from 0)"


# ---- the head summary ------------------------------------------------------------------

SUMMARY_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;line-height:1.4}
p{max-width:70em}
figure{display:inline-block;margin:0 2em 2em 0;vertical-align:top}
figcaption{font-weight:bold;margin-bottom:.3em}
.legend{font-size:12px;max-width:36em;margin-top:.3em}
"""


def _grid_svg(name: str, values: np.ndarray, layers: Sequence[int], heads: Sequence[int],
              decimals: int, unit: str) -> str:
    """A layers × heads grid of coloured cells with the value written in each, and its
    colour bar (the grid's own minimum to maximum) underneath."""
    cw, ch, left, top = 46, 22, 62, 22
    lo, hi = float(values.min()), float(values.max())
    span = hi - lo
    cells = []
    for li, layer in enumerate(layers):
        for hi_, head in enumerate(heads):
            v = float(values[li, hi_])
            fill = _rgb(v, lo, hi)
            ink = "#fff" if span > 0 and (v - lo) / span > 0.55 else "#000"
            x, y = left + hi_ * cw, top + li * ch
            cells.append(f'<rect x="{x}" y="{y}" width="{cw}" height="{ch}" '
                         f'fill="{fill}"><title>layer {layer}, head '
                         f'{head}: {v:.{decimals}f}{unit}</title></rect><text x="{x + cw / 2}" '
                         f'y="{y + ch / 2}" fill="{ink}" text-anchor="middle" '
                         f'dominant-baseline="middle">{v:.{decimals}f}</text>')
    col_labels = "".join(f'<text x="{left + k * cw + cw / 2}" y="{top - 6}" '
                         f'text-anchor="middle">h{h}</text>' for k, h in enumerate(heads))
    row_labels = "".join(f'<text x="{left - 6}" y="{top + k * ch + ch / 2}" text-anchor="end" '
                         f'dominant-baseline="middle">layer {layer}</text>'
                         for k, layer in enumerate(layers))
    width = max(left + cw * len(heads) + 4, 300)
    bar_y = top + ch * len(layers) + 12
    stops = "".join(f'<stop offset="{k / 4:g}" stop-color="{_rgb(k / 4)}"/>' for k in range(5))
    gradient = f"bar-{name}"
    bar = (f'<defs><linearGradient id="{gradient}">{stops}</linearGradient></defs>'
           f'<rect class="colourbar" x="{left}" y="{bar_y}" width="200" height="12" '
           f'fill="url(#{gradient})" stroke="#999"/>'
           f'<text x="{left}" y="{bar_y + 24}" text-anchor="start">{lo:.{decimals}f}</text>'
           f'<text x="{left + 200}" y="{bar_y + 24}" text-anchor="end">{hi:.{decimals}f}</text>')
    height = bar_y + 30
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="grid" width="{width}" '
            f'height="{height}" font-size="11" font-family="sans-serif">{col_labels}'
            f'{row_labels}{"".join(cells)}{bar}</svg>')


def _rgb(value: float, low: float = 0.0, high: float = 1.0) -> str:
    r, g, b = (int(c) for c in colours(np.array(value), low, high))
    return f"rgb({r},{g},{b})"


STAT_UNITS = {"entropy": " nats", "distance": " tokens", "cls": "", "sep": "", "punct": ""}


def render_summary_html(s: HeadSummary) -> str:
    n_layers = s.n_layers or max(s.layers, default=0)
    references = {"entropy": f"uniform attention: {s.uniform_entropy:.2f} nats",
                  "distance": f"uniform attention: {s.uniform_distance:.2f} tokens",
                  "cls": "a share of each query's weight, 0 to 1",
                  "sep": "a share of each query's weight, 0 to 1",
                  "punct": "a share of each query's weight, 0 to 1"}
    sections = []
    for name in STATISTICS:
        values = s.statistics[name]
        d = _decimals(name)
        sections.append(
            f'<figure><figcaption>{html.escape(STAT_TITLES[name])}</figcaption>'
            f'{_grid_svg(name, values, s.layers, s.heads, d, STAT_UNITS[name])}'
            f'<div class="legend">Colour scale of this grid alone: white = its lowest value '
            f'({float(values.min()):.{d}f}{STAT_UNITS[name]}), dark blue = its highest '
            f'({float(values.max()):.{d}f}{STAT_UNITS[name]}); {references[name]}.</div>'
            f'</figure>')
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>What the heads of {html.escape(s.model)} do</title><style>{SUMMARY_STYLE}</style>
</head><body><h1>What the heads of {html.escape(s.model)} do</h1>
<p>Model <b>{html.escape(s.model)}</b>, eager attention in float32; the first chunk of
{counted(len(s.rows), "sampled row")} ({s.n_empty} of {counted(s.n_sampled, "sampled row")}
had no text), {counted(s.n_queries, "query token")}. Each value is a mean over query
tokens; uniform attention would have entropy {s.uniform_entropy:.2f} nats and distance
{s.uniform_distance:.2f} tokens. Rows: layers; columns: heads. {LAYER_NOTE.format(n=n_layers)}
Every grid has its own colour scale, from its lowest value (white) to its highest (dark
blue), stated under it: compare colours within a grid, numbers across grids. Point at a
cell for its layer, head and value.</p>
{"".join(sections)}</body></html>
"""
