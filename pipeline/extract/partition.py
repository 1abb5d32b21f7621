"""One partition, start to finish: read → chunk → encode → aggregate → tables.

This is the unit a Dask worker runs. It is a pure function of (job, partition) plus the
worker's loaded model, so a retried or resumed task writes the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..spec import Job
from ..stores.columns import vector_array
from .aggregate import aggregate_chunks
from .chunking import ChunkedPartition, Specials, chunk_partition, content_budget
from .encode import EncodePlan, Encoder
from .model import LoadedModel
from .modelfiles import load_config, model_shape
from .runtime import Runtime, load_encoder
from .source import Partition, PartitionRows, RowGroupCache, read_partition
from .texthash import text_sha256, unique_texts
from .tokens import kept_positions, token_columns, token_counts
from .views import ForwardNeeds, ResolvedView, forward_needs, resolve_views


@dataclass
class PartTables:
    docs: pa.Table  # row, id, n_tokens, n_chunks, truncated, status, carry..., n_unk,
    #               n_words, n_fragmented, text_sha256, present, views...
    chunks: pa.Table | None  # doc, seq, start, end, n_tokens, views... (None: not stored)
    # n_chunks, n_tokens (in documents), n_covered, n_encoded, n_unique
    stats: dict[str, int]
    # doc, id, position, token_id, token, start, end, token views... (None: no token view)
    tokens: pa.Table | None = None


class Extractor:
    """The loaded model plus everything derived from the job once per worker."""

    def __init__(self, job: Job, threads: int | None = None):
        """`threads`: what a Dask worker was given (else the process's own CPUs decide)."""
        self.job = job
        config = load_config(job.model)
        n_layers, hidden = model_shape(config)
        self.views: list[ResolvedView] = resolve_views(job.views, n_layers, hidden)
        self.needs: ForwardNeeds = forward_needs(self.views, n_layers)
        self.model: LoadedModel
        self.encoder: Encoder
        self.runtime: Runtime  # torch or openvino, and the dtype it computes in
        self.model, self.encoder, self.runtime = load_encoder(job.model, config, self.views,
                                                              self.needs, threads)
        self.specials = Specials.from_tokenizer(self.model.tokenizer)
        self.budget = content_budget(job.chunking, job.model.max_tokens,
                                     self.model.max_positions, self.specials)
        self.row_groups = RowGroupCache()  # partitions sharing a row group decode it once

    def encode_texts(self, texts: list[str | None]) -> EncodedTexts:
        """Chunk, encode and aggregate texts: the whole pipeline minus reading and writing.
        Identical texts are encoded once and the others get copies of its results (not
        with token views: their tokens level keeps one row per stored token)."""
        return self.encode_prepared(self.prepare_texts(texts))

    def prepare_texts(self, texts: list[str | None], pad: bool = False) -> PreparedTexts:
        """Everything `encode_texts` does before the model runs (tokenize, chunk, plan the
        batches; pad them too when `pad`): CPU work only, which another thread may do
        while the model encodes earlier texts."""
        per_token = any(v.per_token for v in self.views)
        distinct, inverse = (list(texts), None) if per_token else unique_texts(texts)
        chunked = chunk_partition(distinct, self.model.tokenizer, self.job.chunking,
                                  self.budget, self.specials, keep_tokens=per_token)
        keep = kept_positions(chunked, len(self.specials.prefix)) if per_token else None
        plan = self.encoder.plan(chunked.chunk_ids, self.job.batching, keep)
        if pad:
            self.encoder.pad(plan)
        return PreparedTexts(len(texts), len(distinct), inverse, chunked, plan)

    def encode_prepared(self, prepared: PreparedTexts) -> EncodedTexts:
        """The model and the views on prepared texts, then chunk vectors → documents."""
        per_token = {v.name for v in self.views if v.per_token}
        chunked = prepared.chunked
        vectors = self.encoder.run(prepared.plan)
        token_vectors = {name: vectors.pop(name) for name in per_token}
        chunk_tokens = chunked.chunk_n_tokens
        doc_vectors = {
            name: aggregate_chunks(v, chunked.chunk_doc, chunk_tokens, prepared.n_distinct,
                                   self.job.chunking.aggregate)
            for name, v in vectors.items()}
        encoded = EncodedTexts(chunked, vectors, doc_vectors, token_vectors,
                               prepared.n_distinct, int(chunk_tokens.sum()))
        inverse = prepared.inverse
        return encoded if inverse is None or prepared.n_distinct == prepared.n_texts else \
            encoded.expanded(inverse)

    def run(self, part: Partition) -> PartTables:
        """Read, chunk, encode and aggregate one partition: its tables."""
        return self.finish(self.prepare(part))

    def prepare(self, part: Partition, pad: bool = False) -> PreparedPart:
        """The partition read, its texts digested, tokenized, chunked and batched (padded
        too when `pad`): everything before the model (see `prepare_texts`)."""
        rows = read_partition(self.job.input, part, self.row_groups)
        return PreparedPart(part, rows, text_sha256(rows.texts),
                            self.prepare_texts(rows.texts, pad))

    def finish(self, prepared: PreparedPart) -> PartTables:
        """A prepared partition through the model: its tables."""
        part, rows = prepared.part, prepared.rows
        encoded = self.encode_prepared(prepared.texts)
        chunked = encoded.chunked
        chunk_tokens = chunked.chunk_n_tokens
        dtype = self.job.output.dtype
        docs: dict[str, pa.Array] = {
            "row": pa.array(np.arange(part.row_start, part.row_stop, dtype=np.int64)),
            "id": rows.ids,
            "n_tokens": pa.array(chunked.n_tokens),
            "n_chunks": pa.array(chunked.n_chunks),
            "truncated": pa.array(chunked.truncated),
            "status": pa.array(chunked.status, pa.string()),
            **rows.carry,
            "n_unk": pa.array(chunked.n_unk),
            "n_words": pa.array(chunked.n_words),
            "n_fragmented": pa.array(chunked.n_fragmented),
            "text_sha256": pa.array(prepared.digests, pa.string()),
            "present": pa.array(np.ones(part.n_rows, bool)),
            **{name: vector_array(v, dtype) for name, v in encoded.docs.items()},
        }
        tokens = None
        if encoded.tokens:
            counts = token_counts(chunked)
            # offsets from this partition's first token; the commit makes them store-wide
            docs["token_offset"] = pa.array(np.cumsum(counts) - counts)
            docs["token_count"] = pa.array(counts)
            tokens = pa.table({
                **token_columns(chunked, self.model.tokenizer, part.row_start, rows.ids),
                **{name: vector_array(v, dtype) for name, v in encoded.tokens.items()},
            })
        chunks = None
        if "chunks" in self.job.output.levels:
            chunks = pa.table({
                "doc": pa.array(chunked.chunk_doc + part.row_start),
                "seq": pa.array(chunked.chunk_seq),
                "start": pa.array(chunked.chunk_start),
                "end": pa.array(chunked.chunk_end),
                "n_tokens": pa.array(chunk_tokens),
                **{name: vector_array(v, dtype) for name, v in encoded.chunks.items()},
            })
        stats = {
            "n_chunks": len(chunk_tokens),
            "n_tokens": int(chunked.n_tokens.sum()),
            "n_covered": int(chunked.n_covered.sum()),
            "n_encoded": encoded.tokens_encoded,  # special tokens and overlap included
            "n_unique": encoded.n_unique,  # texts encoded; the other rows are copies
        }
        if tokens is not None:
            stats["n_stored_tokens"] = tokens.num_rows
        return PartTables(pa.table(docs), chunks, stats, tokens)


@dataclass
class PreparedTexts:
    """Texts tokenized, chunked and batched, not yet encoded (`Extractor.prepare_texts`)."""

    n_texts: int
    n_distinct: int  # texts to encode; the others are copies of one of them
    inverse: np.ndarray | None  # texts[i] = distinct[inverse[i]]; None: all encoded
    chunked: ChunkedPartition  # of the distinct texts
    plan: EncodePlan


@dataclass
class PreparedPart:
    """A partition read and prepared for the model (`Extractor.prepare`)."""

    part: Partition
    rows: PartitionRows
    digests: list[str]  # text_sha256 of each row
    texts: PreparedTexts


@dataclass
class EncodedTexts:
    chunked: ChunkedPartition
    chunks: dict[str, np.ndarray]  # view -> (M, D)
    docs: dict[str, np.ndarray]  # view -> (N, D), NaN rows for empty texts
    # token view -> (K, D): every covered token of every document, in document order
    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    n_unique: int = 0  # distinct texts, each encoded once
    tokens_encoded: int = 0  # tokens fed to the model for them

    def expanded(self, inverse: np.ndarray) -> EncodedTexts:
        """The results for texts[i] = distinct[inverse[i]]: rows and their chunks copied."""
        c = self.chunked
        first = np.cumsum(c.n_chunks) - c.n_chunks  # (U,) first chunk of each distinct text
        counts = c.n_chunks[inverse]  # (N,)
        chunk_doc = np.repeat(np.arange(len(inverse), dtype=np.int64), counts)  # (M',)
        within = np.arange(len(chunk_doc)) - np.repeat(np.cumsum(counts) - counts, counts)
        take = first[inverse][chunk_doc] + within  # (M',) chunk of the distinct text
        n_chunks = len(c.chunk_ids)

        def chunk_field(values: np.ndarray) -> np.ndarray:  # optional (M,) fields
            return values[take] if len(values) == n_chunks else values

        chunked = ChunkedPartition(
            n_tokens=c.n_tokens[inverse], n_covered=c.n_covered[inverse], n_chunks=counts,
            truncated=c.truncated[inverse], status=[c.status[u] for u in inverse],
            chunk_doc=chunk_doc, chunk_seq=c.chunk_seq[take], chunk_start=c.chunk_start[take],
            chunk_end=c.chunk_end[take], chunk_ids=[c.chunk_ids[t] for t in take],
            n_unk=c.n_unk[inverse], n_words=c.n_words[inverse],
            n_fragmented=c.n_fragmented[inverse],
            chunk_tok_start=chunk_field(c.chunk_tok_start),
            chunk_tok_end=chunk_field(c.chunk_tok_end))
        return EncodedTexts(chunked, {k: v[take] for k, v in self.chunks.items()},
                            {k: v[inverse] for k, v in self.docs.items()}, {},
                            self.n_unique, self.tokens_encoded)
