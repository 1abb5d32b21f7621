"""Attention as a diagnostic, never a feature: what the heads of the job's model look at.

Two outputs, both from a separately loaded float32 copy of the job's model switched to
eager attention (the extraction model keeps its fast SDPA kernel, which returns no
attention weights):

- one row (`attention_for_row`): the row's chunk, cut exactly as extraction cuts it, run
  alone; the (layers, heads, T, T) softmax matrices go to `attention.npz` and to a
  self-contained `attention.html` with one token × token heatmap per chosen layer/head.
- a summary over a sample of rows (`summarize_heads`): per head, averaged over every query
  token of every sampled row's first chunk (query i, keys j, weights a_ij, Σ_j a_ij = 1)

      entropy   −Σ_j a_ij ln a_ij        (nats; a uniform row over T tokens has ln T)
      distance  Σ_j a_ij |i − j|         (token positions)
      cls       Σ_{j ∈ prefix specials} a_ij     e.g. [CLS], <s>
      sep       Σ_{j ∈ suffix specials} a_ij     e.g. [SEP], </s>
      punct     Σ_{j punctuation} a_ij   (a content token whose characters, after the
                                          word-piece marker, are all punctuation)

  Query tokens are pooled across rows, so a long row weighs more than a short one.
"""

from __future__ import annotations

import base64
import html
import json
import math
import string
import struct
import unicodedata
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, ModelError, OptionError
from ..extract.batching import plan_batches
from ..extract.chunking import ChunkedPartition, Specials, chunk_partition, content_budget
from ..extract.model import LoadedModel, load_model
from ..extract.source import list_files, open_input, read_text
from ..spec import InputSpec, Job
from .rows import count_rows, read_texts, sample_rows

STATISTICS = ("entropy", "distance", "cls", "sep", "punct")
STAT_TITLES = {
    "entropy": "mean entropy (nats)",
    "distance": "mean attention distance (tokens)",
    "cls": "share of attention on [CLS] (prefix specials)",
    "sep": "share of attention on [SEP] (suffix specials)",
    "punct": "share of attention on punctuation",
}
WORD_PIECE_MARKERS = ("##", "Ġ", "▁")  # WordPiece continuation, byte-level BPE, SentencePiece


# ---- choosing layers, heads, rows ------------------------------------------------------

def parse_indices(text: str | None, count: int, option: str) -> list[int]:
    """'0,5' or '-1' → sorted unique indices in [0, count); None → all."""
    if text is None:
        return list(range(count))
    chosen = []
    for item in text.split(","):
        try:
            i = int(item.strip())
        except ValueError:
            raise OptionError(f"{option}: {item.strip()!r} is not an integer "
                                 f"(comma-separated, e.g. 0,{count - 1})") from None
        if not -count <= i < count:
            raise OptionError(f"{option}: {i} is out of range; the model has {count} "
                                 f"({-count}..{count - 1})")
        chosen.append(i % count)
    return sorted(set(chosen))


def find_row(spec: InputSpec, wanted: str) -> int:
    """The global row number of id `wanted` (compared as text), or `wanted` itself as a row
    number when the job has no id column."""
    files = list_files(spec.path, spec.storage_options)
    if not spec.id_column:
        total = sum(open_input(f, spec.storage_options).metadata.num_rows for f in files)
        try:
            row = int(wanted)
        except ValueError:
            raise InputError(f"--id: the job has no input.id_column, so --id is a row number; "
                             f"got {wanted!r}") from None
        if not 0 <= row < total:
            raise InputError(f"--id: row {row} is out of range (the input has {total} rows)")
        return row
    start, found = 0, []
    for file in files:
        pf = open_input(file, spec.storage_options)
        for batch in pf.iter_batches(columns=[spec.id_column], batch_size=65536):
            ids = batch.column(0).to_pylist()
            found += [start + k for k, value in enumerate(ids)
                      if value is not None and str(value) == wanted]
            start += len(ids)
    if not found:
        raise InputError(f"--id: no row has {spec.id_column} == {wanted!r} in {spec.path}")
    if len(found) > 1:  # never guess which row was meant
        rows = ", ".join(str(r) for r in found[:5]) + (", ..." if len(found) > 5 else "")
        raise InputError(f"--id: {wanted!r} is ambiguous: {len(found)} rows have "
                         f"{spec.id_column} == {wanted!r} (rows {rows})")
    return found[0]


# ---- the eager model -------------------------------------------------------------------

class EagerAttention:
    """The job's model in float32 with eager attention, and the job's own chunking."""

    def __init__(self, job: Job):
        self.job = job
        self.model: LoadedModel = load_model(replace(job.model, dtype="float32"))
        module: Any = self.model.module
        try:
            module.set_attn_implementation("eager")
        except (AttributeError, ValueError) as exc:
            raise ModelError(f"model.path: {job.model.path!r} cannot switch to eager "
                             f"attention: {exc}") from None
        self.tokenizer = self.model.tokenizer
        self.specials = Specials.from_tokenizer(self.tokenizer)
        self.budget = content_budget(job.chunking, job.model.max_tokens,
                                     self.model.max_positions, self.specials)

    @property
    def n_layers(self) -> int:
        return self.model.n_layers

    @property
    def n_heads(self) -> int:
        config: Any = self.model.module.config
        return int(config.num_attention_heads)

    def chunk(self, texts: Sequence[str | None]) -> ChunkedPartition:
        return chunk_partition(texts, self.tokenizer, self.job.chunking, self.budget,
                               self.specials)

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(ids))]

    def attentions(self, sequences: Sequence[Sequence[int]]) -> Iterator[tuple[int, np.ndarray]]:
        """(index, (layers, heads, T, T) float32) per sequence, in batches of the job's
        token budget; padded keys get exactly zero weight and padded queries are cut off."""
        import torch

        lengths = [len(s) for s in sequences]
        pad_id = int(self.tokenizer.pad_token_id or 0)
        batching = self.job.batching
        for idx in plan_batches(lengths, batching.max_tokens_per_batch,
                                batching.max_batch_size):
            longest = max(lengths[i] for i in idx)
            ids = torch.full((len(idx), longest), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), longest), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, : lengths[i]] = torch.as_tensor(list(sequences[i]), dtype=torch.long)
                mask[row, : lengths[i]] = 1
            with torch.inference_mode():
                out = self.model.module(input_ids=ids.to(self.model.device),
                                        attention_mask=mask.to(self.model.device),
                                        output_attentions=True, return_dict=True)
            if not out.attentions:
                raise ModelError(f"model.path: {self.job.model.path!r} returned no attention "
                                 "weights even in eager mode")
            stacked = torch.stack(out.attentions, dim=1).float().cpu().numpy()  # (B,L,nh,T,T)
            for row, i in enumerate(idx):
                n = lengths[i]
                yield int(i), stacked[row, :, :, :n, :n]


# ---- one row ---------------------------------------------------------------------------

@dataclass
class RowAttention:
    row: int
    row_id: str
    chunk: int
    n_chunks: int
    span: tuple[int, int]  # characters of the row's text in this chunk
    token_ids: list[int]
    tokens: list[str]
    layers: list[int]
    heads: list[int]
    attentions: np.ndarray  # (layers, heads, T, T) float32, rows = queries
    model: str

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


def attention_for_row(job: Job, wanted_id: str, layers: str | None = None,
                      heads: str | None = None, chunk: int = 0,
                      model: EagerAttention | None = None) -> RowAttention:
    """The attention matrices of one row's chunk, run alone (no padding)."""
    model = model or EagerAttention(job)
    chosen_layers = parse_indices(layers, model.n_layers, "--layers")
    chosen_heads = parse_indices(heads, model.n_heads, "--heads")
    row = find_row(job.input, wanted_id)
    text = read_text(job.input, row)
    chunked = model.chunk([text])
    n_chunks = int(chunked.n_chunks[0])
    if n_chunks == 0:
        raise InputError(f"--id {wanted_id}: row {row} has an empty text; nothing to encode")
    if not 0 <= chunk < n_chunks:
        raise OptionError(f"--chunk: {chunk} is out of range; row {row} (id {wanted_id}) "
                             f"has {n_chunks} chunk{'s' if n_chunks > 1 else ''} "
                             f"(0..{n_chunks - 1})")
    ids = chunked.chunk_ids[chunk]
    _, matrices = next(model.attentions([ids]))
    picked = matrices[np.ix_(chosen_layers, chosen_heads)]  # (l, h, T, T)
    return RowAttention(
        row=row, row_id=wanted_id, chunk=chunk, n_chunks=n_chunks,
        span=(int(chunked.chunk_start[chunk]), int(chunked.chunk_end[chunk])),
        token_ids=list(ids), tokens=model.tokens(ids), layers=chosen_layers,
        heads=chosen_heads, attentions=np.ascontiguousarray(picked, np.float32),
        model=job.model.path)


# ---- per-head statistics ---------------------------------------------------------------

def is_punctuation(token: str) -> bool:
    """Every character of the token (word-piece marker removed) is punctuation: Unicode
    category P*, or an ASCII symbol such as $ + < = > ^ ` | ~ (BERT's own definition)."""
    for marker in WORD_PIECE_MARKERS:
        if token.startswith(marker) and len(token) > len(marker):
            token = token[len(marker):]
            break
    return bool(token) and all(
        ch in string.punctuation or unicodedata.category(ch).startswith("P") for ch in token)


@dataclass
class TokenKinds:
    """Which key positions of one sequence are prefix specials, suffix specials, punctuation."""

    cls: np.ndarray  # (T,) bool
    sep: np.ndarray
    punct: np.ndarray

    @classmethod
    def of(cls, tokens: Sequence[str], specials: Specials) -> TokenKinds:
        t = len(tokens)
        pos = np.arange(t)
        prefix = pos < len(specials.prefix)
        suffix = pos >= t - len(specials.suffix)
        punct = np.array([is_punctuation(tok) for tok in tokens], bool) & ~prefix & ~suffix
        return cls(prefix, suffix, punct)


@dataclass
class HeadStatistics:
    """Running sums over query tokens; `means()` gives the (layers, heads) averages."""

    n_layers: int
    n_heads: int
    sums: dict[str, np.ndarray] = field(init=False)
    n_queries: int = 0
    n_sequences: int = 0
    log_t_sum: float = 0.0  # Σ over queries of ln T: the entropy of uniform attention
    uniform_distance_sum: float = 0.0  # Σ over queries of uniform attention's distance

    def __post_init__(self) -> None:
        self.sums = {k: np.zeros((self.n_layers, self.n_heads)) for k in STATISTICS}

    def add(self, attention: np.ndarray, kinds: TokenKinds) -> None:
        """attention: (layers, heads, T, T), rows = queries over the sequence's T keys."""
        a = attention.astype(np.float64)
        t = a.shape[-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            plogp = np.where(a > 0, a * np.log(a), 0.0)
        pos = np.arange(t)
        dist = np.abs(pos[:, None] - pos[None, :])  # (T, T)
        self.sums["entropy"] += -plogp.sum(axis=(-1, -2))
        self.sums["distance"] += (a * dist).sum(axis=(-1, -2))
        for name, mask in (("cls", kinds.cls), ("sep", kinds.sep), ("punct", kinds.punct)):
            self.sums[name] += a[..., mask].sum(axis=(-1, -2))
        self.n_queries += t
        self.n_sequences += 1
        self.log_t_sum += t * math.log(t)
        self.uniform_distance_sum += (t * t - 1) / 3  # Σ_i (1/T) Σ_j |i − j|

    def means(self) -> dict[str, np.ndarray]:
        n = max(self.n_queries, 1)
        return {k: v / n for k, v in self.sums.items()}

    @property
    def uniform_entropy(self) -> float:
        return self.log_t_sum / max(self.n_queries, 1)

    @property
    def uniform_distance(self) -> float:
        return self.uniform_distance_sum / max(self.n_queries, 1)


@dataclass
class HeadSummary:
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
        lines = [f"attention summary of {self.model}: first chunk of {len(self.rows)} sampled "
                 f"rows ({self.n_empty} of {self.n_sampled} sampled rows were empty), "
                 f"{self.n_queries} query tokens; uniform attention would have entropy "
                 f"{self.uniform_entropy:.2f} and distance {self.uniform_distance:.2f}"]
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


def summarize_heads(job: Job, sample: int = 100, seed: int = 0, layers: str | None = None,
                    heads: str | None = None, model: EagerAttention | None = None
                    ) -> HeadSummary:
    """Per-head statistics over the first chunk of a fixed-seed sample of input rows."""
    if sample < 1:
        raise OptionError(f"--sample: {sample} must be at least 1")
    model = model or EagerAttention(job)
    chosen_layers = parse_indices(layers, model.n_layers, "--layers")
    chosen_heads = parse_indices(heads, model.n_heads, "--heads")
    wanted = sample_rows(count_rows(job.input), sample, seed)
    texts = read_texts(job.input, wanted)
    stats = HeadStatistics(len(chosen_layers), len(chosen_heads))
    chunked = model.chunk(texts)
    # each sampled row's first chunk; rows without text have none
    firsts = {int(d): k for k, (d, s) in enumerate(zip(chunked.chunk_doc, chunked.chunk_seq,
                                                       strict=True)) if s == 0}
    order = sorted(firsts)
    sequences = [chunked.chunk_ids[firsts[d]] for d in order]
    for i, matrices in model.attentions(sequences):
        picked = matrices[np.ix_(chosen_layers, chosen_heads)]
        stats.add(picked, TokenKinds.of(model.tokens(sequences[i]), model.specials))
    kept = [wanted[d] for d in order]
    return HeadSummary(model=job.model.path, layers=chosen_layers, heads=chosen_heads,
                       rows=sorted(kept), n_sampled=len(wanted),
                       n_empty=len(wanted) - len(kept), n_queries=stats.n_queries,
                       uniform_entropy=stats.uniform_entropy,
                       uniform_distance=stats.uniform_distance, statistics=stats.means())


# ---- HTML: inline SVG, heatmaps as PNG data URIs, no scripts or external assets ---------

LOW = np.array([255.0, 255.0, 255.0])  # white at zero
HIGH = np.array([8.0, 48.0, 107.0])  # dark blue at the scale's maximum


def colours(values: np.ndarray, top: float) -> np.ndarray:
    """Linear white → dark blue over [0, top]; uint8 (..., 3)."""
    scale = np.clip(values / top, 0.0, 1.0) if top > 0 else np.zeros_like(values)
    return np.round(LOW + (HIGH - LOW) * scale[..., None]).astype(np.uint8)


def png_bytes(rgb: np.ndarray) -> bytes:
    """A (h, w, 3) uint8 image as PNG (8-bit RGB, filter 0), with zlib only."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _heatmap_svg(matrix: np.ndarray, tokens: Sequence[str], title: str) -> str:
    """One token × token heatmap: queries down the left, keys along the top."""
    t = len(tokens)
    cell = max(2.0, min(16.0, 480.0 / t))
    every = max(1, math.ceil(7.0 / cell))  # label every k-th token when cells are tiny
    font = min(11.0, cell * every * 0.8)
    margin = 8 + 6.5 * min(24, max(len(tok) for tok in tokens))
    size = cell * t
    top = float(matrix.max())
    png = base64.b64encode(png_bytes(colours(matrix.astype(np.float64), top))).decode()
    labels = []
    for i in range(0, t, every):
        tok = html.escape(tokens[i][:24])
        y = margin + (i + 0.5) * cell
        labels.append(f'<text x="{margin - 4:.1f}" y="{y:.1f}" text-anchor="end" '
                      f'dominant-baseline="middle">{tok}</text>')
        labels.append(f'<text transform="translate({margin + (i + 0.5) * cell:.1f},'
                      f'{margin - 4:.1f}) rotate(-90)" dominant-baseline="middle">{tok}</text>')
    full = margin + size + 4
    return (f'<figure><figcaption>{html.escape(title)} (darkest = {top:.3f})</figcaption>'
            f'<svg xmlns="http://www.w3.org/2000/svg" class="heatmap" width="{full:.0f}" '
            f'height="{full:.0f}" font-size="{font:.1f}" font-family="monospace">'
            f'<image x="{margin:.1f}" y="{margin:.1f}" width="{size:.1f}" height="{size:.1f}" '
            f'preserveAspectRatio="none" style="image-rendering:pixelated" '
            f'href="data:image/png;base64,{png}"/>'
            f'<rect x="{margin:.1f}" y="{margin:.1f}" width="{size:.1f}" height="{size:.1f}" '
            f'fill="none" stroke="#999"/>{"".join(labels)}</svg></figure>')


PAGE_STYLE = ("body{font-family:sans-serif;margin:2em}figure{display:inline-block;"
              "margin:0 1.5em 1.5em 0;vertical-align:top}figcaption{font-weight:bold}"
              "table{border-collapse:collapse}td,th{padding:2px 8px}")


def render_row_html(r: RowAttention) -> str:
    figures = "".join(
        _heatmap_svg(r.attentions[li, hi], r.tokens, f"layer {layer}, head {head}")
        for li, layer in enumerate(r.layers) for hi, head in enumerate(r.heads))
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>bertpipe attention: '
            f'row {html.escape(r.row_id)}</title><style>{PAGE_STYLE}</style></head><body>'
            f'<h1>Attention of row {html.escape(r.row_id)}</h1>'
            f'<p>Model {html.escape(r.model)}, eager attention in float32. Row {r.row}, chunk '
            f'{r.chunk} of {r.n_chunks} (characters {r.span[0]}..{r.span[1]}), {len(r.tokens)} '
            f'tokens. Each map: queries down the left, keys along the top; a row of a map '
            f'sums to 1; white = 0, darkest = the map\'s largest weight.</p>'
            f'{figures}</body></html>\n')


def _grid_svg(values: np.ndarray, layers: Sequence[int], heads: Sequence[int],
              decimals: int) -> str:
    """A layers × heads grid of coloured cells with the value written in each."""
    cw, ch, left, top = 46, 22, 52, 22
    lo, hi = float(values.min()), float(values.max())
    span = hi - lo
    cells = []
    for li, layer in enumerate(layers):
        for hi_, _ in enumerate(heads):
            v = float(values[li, hi_])
            rgb = colours(np.array(v - lo), span)
            fill = f"rgb({rgb[0]},{rgb[1]},{rgb[2]})"
            ink = "#fff" if span > 0 and (v - lo) / span > 0.55 else "#000"
            x, y = left + hi_ * cw, top + li * ch
            cells.append(f'<rect x="{x}" y="{y}" width="{cw}" height="{ch}" fill="{fill}">'
                         f'<title>layer {layer}, head {heads[hi_]}: {v:.{decimals}f}</title>'
                         f'</rect><text x="{x + cw / 2}" y="{y + ch / 2}" fill="{ink}" '
                         f'text-anchor="middle" dominant-baseline="middle">'
                         f'{v:.{decimals}f}</text>')
    col_labels = "".join(f'<text x="{left + k * cw + cw / 2}" y="{top - 6}" '
                         f'text-anchor="middle">h{h}</text>' for k, h in enumerate(heads))
    row_labels = "".join(f'<text x="{left - 6}" y="{top + k * ch + ch / 2}" text-anchor="end" '
                         f'dominant-baseline="middle">L{layer}</text>'
                         for k, layer in enumerate(layers))
    width, height = left + cw * len(heads) + 4, top + ch * len(layers) + 4
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="grid" width="{width}" '
            f'height="{height}" font-size="11" font-family="sans-serif">{col_labels}'
            f'{row_labels}{"".join(cells)}</svg>')


def render_summary_html(s: HeadSummary) -> str:
    sections = "".join(
        f'<figure><figcaption>{html.escape(STAT_TITLES[name])}</figcaption>'
        f'{_grid_svg(s.statistics[name], s.layers, s.heads, _decimals(name))}'
        f'</figure>' for name in STATISTICS)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>bertpipe attention '
            f'summary</title><style>{PAGE_STYLE}</style></head><body>'
            f'<h1>What the heads do</h1><p>Model {html.escape(s.model)}, eager attention in '
            f'float32, first chunk of {len(s.rows)} sampled rows, {s.n_queries} query tokens. '
            f'Each value is a mean over query tokens; uniform attention would have entropy '
            f'{s.uniform_entropy:.2f} nats and distance {s.uniform_distance:.2f} tokens. '
            f'Rows: layers (0 = first transformer block); '
            f'columns: heads; each grid is coloured from its own minimum to maximum.</p>'
            f'{sections}</body></html>\n')
