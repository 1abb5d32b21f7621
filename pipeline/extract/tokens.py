"""Token views: which chunk each token is taken from, and a partition's tokens table.

Special tokens are never stored. Without overlap every content token is in exactly one
chunk. With `chunking.overlap` a token can sit in two (or more) chunks; it is stored once,
from the chunk where it has the most context on both sides:

    context(t, k) = min(t - tok_start_k, tok_end_k - 1 - t)   (tokens left and right of t
                                                              inside chunk k)
    owner(t)      = argmax_k context(t, k), the earlier chunk on a tie

Chunk ranges have non-decreasing starts and increasing ends, so once a later chunk beats
an earlier one it keeps doing so further right: every chunk owns one contiguous range and
the owned ranges tile the document's covered tokens [0, n_covered) in order.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from .chunking import ChunkedPartition


def owned_ranges(chunk_doc: np.ndarray, tok_start: np.ndarray, tok_end: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(M,) [own_start, own_end) per chunk, in its document's token indices (see the
    module docstring); an empty range at tok_start for a chunk that owns nothing."""
    own_start = tok_start.copy()
    own_end = tok_start.copy()
    bounds = np.flatnonzero(np.diff(chunk_doc)) + 1  # chunks are grouped by document
    for group in np.split(np.arange(len(chunk_doc)), bounds):
        if len(group) == 0:
            continue
        first = int(tok_start[group].min())
        n = int(tok_end[group].max()) - first
        best = np.full(n, -1, np.int64)
        owner = np.full(n, -1, np.int64)
        for k in group:
            t = np.arange(tok_start[k], tok_end[k])
            context = np.minimum(t - tok_start[k], tok_end[k] - 1 - t)
            wins = context > best[t - first]  # strict: a tie stays with the earlier chunk
            best[t[wins] - first] = context[wins]
            owner[t[wins] - first] = k
        for k in group:
            mine = np.flatnonzero(owner == k)
            if len(mine):
                own_start[k], own_end[k] = first + mine[0], first + mine[-1] + 1
    return own_start, own_end


def kept_positions(chunked: ChunkedPartition, prefix: int) -> list[tuple[int, int]]:
    """Per chunk the positions [lo, hi) of its owned tokens within its encoded sequence
    (which starts with `prefix` special tokens)."""
    own_start, own_end = owned_ranges(chunked.chunk_doc, chunked.chunk_tok_start,
                                      chunked.chunk_tok_end)
    lo = own_start - chunked.chunk_tok_start + prefix
    hi = own_end - chunked.chunk_tok_start + prefix
    return list(zip(lo.tolist(), hi.tolist(), strict=True))


def token_counts(chunked: ChunkedPartition) -> np.ndarray:
    """(N,) tokens stored per document: every covered token (0 for an empty text)."""
    return np.where(np.asarray(chunked.status) == "ok", chunked.n_covered, 0).astype(np.int64)


def token_columns(chunked: ChunkedPartition, tokenizer: Any, row_start: int,
                  ids: pa.Array) -> dict[str, pa.Array]:
    """The tokens table's fields other than the vectors, in document then position order:
    doc (row), id (the row's id), position, token_id, token (the word piece), start and
    end (character offsets into the row's text)."""
    counts = token_counts(chunked)
    local = np.repeat(np.arange(len(counts)), counts)
    position = np.concatenate([np.arange(c) for c in counts]) if len(counts) else local
    token_id = _concat([chunked.doc_token_ids[i][:c] for i, c in enumerate(counts)], (0,))
    offsets = _concat([chunked.doc_offsets[i][:c] for i, c in enumerate(counts)], (0, 2))
    return {
        "doc": pa.array(local + row_start),
        "id": ids.take(pa.array(local)),
        "position": pa.array(position.astype(np.int64)),
        "token_id": pa.array(token_id),
        "token": pa.array(tokenizer.convert_ids_to_tokens(token_id.tolist()), pa.string()),
        "start": pa.array(offsets[:, 0]),
        "end": pa.array(offsets[:, 1]),
    }


def _concat(pieces: list[np.ndarray], empty_shape: tuple[int, ...]) -> np.ndarray:
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(empty_shape, np.int64)
