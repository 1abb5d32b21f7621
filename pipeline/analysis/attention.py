"""Attention as a diagnostic, never a feature: what the heads of the job's model look at.

Two outputs, both from a separately loaded float32 copy of the job's model switched to
eager attention (the extraction model keeps its fast SDPA kernel, which returns no
attention weights):

- one row (`attention_for_row`): the row's chunk, cut exactly as extraction cuts it, run
  alone; the (layers, heads, T, T) softmax matrices go to `attention.npz` and to a
  self-contained `attention.html` (a layer × head picker, the chosen map with every token
  labelled, and a head view; see `attention_page`).
- a summary over a sample of rows (`summarize_heads`): per head, averaged over every query
  token of every sampled row's first chunk (query i, keys j, weights a_ij, Σ_j a_ij = 1)

      entropy   −Σ_j a_ij ln a_ij        (nats; a uniform row over T tokens has ln T)
      distance  Σ_j a_ij |i − j|         (token positions)
      cls       Σ_{j ∈ prefix specials} a_ij     e.g. [CLS], <s>
      sep       Σ_{j ∈ suffix specials} a_ij     e.g. [SEP], </s>
      punct     Σ_{j punctuation} a_ij   (a content token whose characters, after the
                                          word-piece marker, are all punctuation)

  Query tokens are pooled across rows, so a long row weighs more than a short one.

Layers are numbered as everywhere in bertpipe: hidden state 0 is the embeddings and hidden
state k the output of transformer block k, so the attention inside block k is layer k
(1..L). Layer 0 has no attention. Heads are numbered from 0.
"""

from __future__ import annotations

import math
import string
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import InputError, ModelError, OptionError
from ..extract.batching import plan_batches
from ..extract.chunking import ChunkedPartition, Specials, chunk_partition, content_budget
from ..extract.model import LoadedModel, load_model
from ..extract.source import list_files, open_input, read_text
from ..spec import InputSpec, Job
from .attention_page import STATISTICS, HeadSummary, RowAttention
from .page import model_name
from .rows import count_rows, read_texts, sample_rows

WORD_PIECE_MARKERS = ("##", "Ġ", "▁")  # WordPiece continuation, byte-level BPE, SentencePiece


# ---- choosing layers, heads, rows ------------------------------------------------------

def _integers(text: str, option: str, example: str) -> list[int]:
    values = []
    for item in text.split(","):
        try:
            values.append(int(item.strip()))
        except ValueError:
            raise OptionError(f"{option}: {item.strip()!r} is not an integer "
                              f"(comma-separated, e.g. {example})") from None
    return values


def parse_indices(text: str | None, count: int, option: str) -> list[int]:
    """'0,5' or '-1' → sorted unique indices in [0, count); None → all (heads)."""
    if text is None:
        return list(range(count))
    chosen = []
    for i in _integers(text, option, f"0,{count - 1}"):
        if not -count <= i < count:
            raise OptionError(f"{option}: {i} is out of range; the model has {count} "
                              f"({-count}..{count - 1})")
        chosen.append(i % count)
    return sorted(set(chosen))


def parse_layers(text: str | None, count: int) -> list[int]:
    """'1,6' or '-1' → sorted unique layers in 1..count (layer k = block k, as hidden
    state k is its output); None → all. 0 is the embeddings, which have no attention."""
    if text is None:
        return list(range(1, count + 1))
    chosen = []
    for k in _integers(text, "--layers", f"1,{count}"):
        if k == 0:
            raise OptionError(f"--layers: 0 is the embeddings (hidden state 0), which have no "
                              f"attention; attention layers are 1..{count} (layer k is "
                              f"transformer block k), or -1 for the last")
        if not -count <= k <= count:
            raise OptionError(f"--layers: {k} is out of range; the model has {count} layers "
                              f"(1..{count}, or {-count}..-1 from the end)")
        chosen.append(k if k > 0 else count + 1 + k)
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

def attention_for_row(job: Job, wanted_id: str, layers: str | None = None,
                      heads: str | None = None, chunk: int = 0,
                      model: EagerAttention | None = None) -> RowAttention:
    """The attention matrices of one row's chunk, run alone (no padding)."""
    model = model or EagerAttention(job)
    chosen_layers = parse_layers(layers, model.n_layers)
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
    picked = matrices[np.ix_(_blocks(chosen_layers), chosen_heads)]  # (l, h, T, T)
    return RowAttention(
        row=row, row_id=wanted_id, chunk=chunk, n_chunks=n_chunks,
        span=(int(chunked.chunk_start[chunk]), int(chunked.chunk_end[chunk])),
        token_ids=list(ids), tokens=model.tokens(ids), layers=chosen_layers,
        heads=chosen_heads, attentions=np.ascontiguousarray(picked, np.float32),
        model=model_name(job.model.path), n_layers=model.n_layers)


def _blocks(layers: Sequence[int]) -> list[int]:
    """Positions in the model's attention outputs (block k is the k-th, 0-based) of
    1-based layers."""
    return [k - 1 for k in layers]


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


def summarize_heads(job: Job, sample: int = 100, seed: int = 0, layers: str | None = None,
                    heads: str | None = None, model: EagerAttention | None = None
                    ) -> HeadSummary:
    """Per-head statistics over the first chunk of a fixed-seed sample of input rows."""
    if sample < 1:
        raise OptionError(f"--sample: {sample} must be at least 1")
    model = model or EagerAttention(job)
    chosen_layers = parse_layers(layers, model.n_layers)
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
        picked = matrices[np.ix_(_blocks(chosen_layers), chosen_heads)]
        stats.add(picked, TokenKinds.of(model.tokens(sequences[i]), model.specials))
    kept = [wanted[d] for d in order]
    return HeadSummary(model=model_name(job.model.path), layers=chosen_layers, heads=chosen_heads,
                       rows=sorted(kept), n_sampled=len(wanted),
                       n_empty=len(wanted) - len(kept), n_queries=stats.n_queries,
                       uniform_entropy=stats.uniform_entropy,
                       uniform_distance=stats.uniform_distance, statistics=stats.means(),
                       n_layers=model.n_layers)
