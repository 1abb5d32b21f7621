"""Chunk vectors → document vectors: pure NumPy, float64 accumulation."""

from __future__ import annotations

import numpy as np

AGGREGATES = ("mean", "mean_unweighted", "max", "first")


def aggregate_chunks(vectors: np.ndarray, chunk_doc: np.ndarray, chunk_tokens: np.ndarray,
                     n_docs: int, method: str) -> np.ndarray:
    """Document vectors from chunk vectors (float64 accumulation); NaN for docs without chunks.

    mean             Σ_c n_c v_c / Σ_c n_c     (n_c = chunk tokens incl. special tokens)
    mean_unweighted  (1/C) Σ_c v_c
    max              max_c v_c per dimension
    first            v_0
    """
    width = vectors.shape[1]
    out = np.full((n_docs, width), np.nan, dtype=np.float64)
    if len(chunk_doc) == 0:
        return out.astype(np.float32)
    v = vectors.astype(np.float64)
    if method in ("mean", "mean_unweighted"):
        w = chunk_tokens.astype(np.float64) if method == "mean" else np.ones(len(chunk_doc))
        sums = np.zeros((n_docs, width))
        np.add.at(sums, chunk_doc, v * w[:, None])
        totals = np.bincount(chunk_doc, weights=w, minlength=n_docs)
        has = totals > 0
        out[has] = sums[has] / totals[has, None]
    elif method == "max":
        acc = np.full((n_docs, width), -np.inf)
        np.maximum.at(acc, chunk_doc, v)
        has = np.isfinite(acc[:, 0])
        out[has] = acc[has]
    elif method == "first":
        # chunks are stored in document order, so a document's first row is its seq 0
        docs, first = np.unique(chunk_doc, return_index=True)
        out[docs] = v[first]
    else:
        raise ValueError(f"chunking.aggregate: unknown {method!r}; valid: {', '.join(AGGREGATES)}")
    return out.astype(np.float32)
